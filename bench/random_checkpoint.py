"""Random-weight HF DeepSeek checkpoints of any shape: config.json, sharded safetensors, tokenizer.

The serving benchmark needs a checkpoint with a real model's shape (DeepSeek-V2-Lite, 15.3B
parameters with the tiny tokenizer's vocabulary) but nothing to download. Tensors are drawn on
`device` (a GPU draws 15B parameters in seconds) and written shard by shard, so host memory holds
one shard at a time. Names and shapes are HF's (`save_pretrained`'s per-expert form), derived from
`ModelConfig`, so our loader, the workers and the router treat the result as a real model.

    from random_checkpoint import v2_lite_config, write_random_checkpoint
    write_random_checkpoint("/tmp/v2lite", v2_lite_config(), device="cuda")   # vocab: the tokenizer's

Scales: linear weights ~ N(0, 1/in_features), norms 1, embeddings N(0, 1): activations stay O(1)
over 27 layers in bf16 and the MoE gate's logits are O(1), so routing spreads over the experts
roughly as a trained model's does under random prompts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import torch

from deepseek_pd.operator.known_models import KNOWN_MODELS

# The DeepSeek-V2-Lite shape (operator/known_models.py, ../shared/FACTS.md) with a random tokenizer's
# special ids; vocab_size is set by the caller (else the tokenizer's).
V2_LITE = {**{k: v for k, v in KNOWN_MODELS["DeepSeek-V2-Lite"].items() if k != "vocab_size"},
           "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu"}

# The same family in miniature, for CPU runs of the serving benchmark (`--tiny`).
V2_MINI = {**V2_LITE, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
           "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "max_position_embeddings": 4096, "torch_dtype": "float32",
           "rope_scaling": {**V2_LITE["rope_scaling"], "factor": 4.0, "original_max_position_embeddings": 1024}}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NORM = "norm"  # a shape tagged as a norm weight is filled with ones


def v2_lite_config(vocab_size: int | None = None, **overrides) -> dict:
    """V2-Lite's config.json; `vocab_size=None` takes the tokenizer's when the checkpoint is written."""
    return {**V2_LITE, **overrides, **({} if vocab_size is None else {"vocab_size": vocab_size})}


def hf_tensor_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, kind) with kind "norm", "bias" (fp32 score correction) or "linear"."""
    from deepseek_pd.model.config import ModelConfig

    cfg = ModelConfig.from_hf(config)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, hidden), "embedding"),
        "model.norm.weight": ((hidden,), _NORM),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = ((cfg.vocab_size, hidden), "linear")

    def mlp(prefix: str, inner: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = ((inner, hidden), "linear")
        shapes[f"{prefix}.up_proj.weight"] = ((inner, hidden), "linear")
        shapes[f"{prefix}.down_proj.weight"] = ((hidden, inner), "linear")

    for layer in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        p = f"model.layers.{layer}"
        if layer >= cfg.num_hidden_layers:  # an MTP layer (model/speculative/mtp.py) around its decoder layer
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                shapes[f"{p}.{norm}.weight"] = ((hidden,), _NORM)
            shapes[f"{p}.eh_proj.weight"] = ((hidden, 2 * hidden), "linear")
        shapes[f"{p}.input_layernorm.weight"] = ((hidden,), _NORM)
        shapes[f"{p}.post_attention_layernorm.weight"] = ((hidden,), _NORM)
        attn = f"{p}.self_attn"
        if cfg.q_lora_rank is None:
            shapes[f"{attn}.q_proj.weight"] = ((heads * cfg.qk_head_dim, hidden), "linear")
        else:
            shapes[f"{attn}.q_a_proj.weight"] = ((cfg.q_lora_rank, hidden), "linear")
            shapes[f"{attn}.q_a_layernorm.weight"] = ((cfg.q_lora_rank,), _NORM)
            shapes[f"{attn}.q_b_proj.weight"] = ((heads * cfg.qk_head_dim, cfg.q_lora_rank), "linear")
        shapes[f"{attn}.kv_a_proj_with_mqa.weight"] = ((cfg.kv_cache_dim, hidden), "linear")
        shapes[f"{attn}.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), _NORM)
        shapes[f"{attn}.kv_b_proj.weight"] = (
            (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "linear")
        shapes[f"{attn}.o_proj.weight"] = ((hidden, heads * cfg.v_head_dim), "linear")
        if not cfg.is_moe_layer(layer):
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        shapes[f"{p}.mlp.gate.weight"] = ((cfg.n_routed_experts, hidden), "linear")
        if cfg.topk_method == "noaux_tc":
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = ((cfg.n_routed_experts,), "bias")
        for expert in range(cfg.n_routed_experts):
            mlp(f"{p}.mlp.experts.{expert}", cfg.moe_intermediate_size)
        if cfg.n_shared_experts:
            mlp(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)
    return shapes


def num_parameters(config: dict) -> int:
    return sum(math.prod(shape) for shape, _ in hf_tensor_shapes(config).values())


def _draw(shape: tuple[int, ...], kind: str, dtype: torch.dtype, device: str,
          gen: torch.Generator) -> torch.Tensor:
    if kind == _NORM:
        return torch.ones(shape, dtype=dtype, device=device)
    if kind == "bias":  # DeepSeek keeps the score-correction bias in fp32
        return 0.05 * torch.randn(shape, dtype=torch.float32, device=device, generator=gen)
    tensor = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    if kind == "linear":
        tensor.mul_(1.0 / math.sqrt(shape[1]))
    return tensor


def _shards(shapes: dict[str, tuple[tuple[int, ...], str]], dtype: torch.dtype,
            shard_bytes: int) -> Iterator[list[str]]:
    """Names grouped in file order into shards of about `shard_bytes` (a tensor never splits)."""
    group: list[str] = []
    size = 0
    for name, (shape, _) in shapes.items():
        nbytes = math.prod(shape) * (4 if name.endswith("e_score_correction_bias") else dtype.itemsize)
        if group and size + nbytes > shard_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


@torch.inference_mode()
def write_random_checkpoint(directory: str | Path, config: dict, device: str = "cpu", seed: int = 0,
                            shard_bytes: int = 4 << 30) -> Path:
    """Writes config.json, generation_config.json, the tiny tokenizer and random weights in
    `config["torch_dtype"]`; a missing `vocab_size` becomes the tokenizer's. Returns the directory."""
    from safetensors.torch import save_file

    from deepseek_pd.model.checkpoint.tokenizer_builder import write_tokenizer_files

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_tokenizer_files(directory, max_length=config["max_position_embeddings"])
    config = {"vocab_size": tokenizer_vocab, **config}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    dtype = _DTYPES[config["torch_dtype"]]
    shapes = hf_tensor_shapes(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = list(_shards(shapes, dtype, shard_bytes))
    weight_map, total = {}, 0
    for index, names in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _draw(*shapes[name], dtype, device, gen).cpu() for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    return directory


STAMP = "random-checkpoint.json"  # written last: its presence means the checkpoint is complete


def ensure_random_checkpoint(directory: str | Path, config: dict, device: str = "cpu", seed: int = 0) -> bool:
    """Writes the checkpoint unless `directory` already holds this exact one; True if it wrote."""
    directory = Path(directory)
    want = {"config": config, "seed": seed}
    try:
        if json.loads((directory / STAMP).read_text()) == want:
            return False
    except (OSError, ValueError):
        pass
    (directory / STAMP).unlink(missing_ok=True)
    write_random_checkpoint(directory, config, device=device, seed=seed)
    (directory / STAMP).write_text(json.dumps(want) + "\n")
    return True


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--shape", choices=["v2-lite", "v2-mini"], default="v2-lite")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = v2_lite_config() if args.shape == "v2-lite" else dict(V2_MINI)
    wrote = ensure_random_checkpoint(args.directory, config, args.device, args.seed)
    written = json.loads((Path(args.directory) / "config.json").read_text())
    print(json.dumps({"directory": args.directory, "written": wrote, "parameters": num_parameters(written)}))


if __name__ == "__main__":
    main()
