"""The embedded tiny checkpoint: a deterministic, HF-format DeepSeek-V3 (or V2) with random weights.

`make_tiny_model(dir)` writes exactly what a real HF repo has (config.json, model.safetensors with
HF parameter names, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json), so everything downstream (our loader, HF transformers, the router) treats
it as a real model. The shape is V3's in miniature: q_lora, noaux_tc sigmoid routing over 4 groups
of 2 experts, one shared expert, one dense layer first, YaRN rope; V2's variant has no q_lora
and softmax group-limited-greedy routing. `model_dir.resolve_model_dir("tiny")` generates it once into the
cache directory, atomically, so concurrent workers never see half a model.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig, hf_quantization_config, quantize_checkpoint
from deepseek_pd.model.checkpoint.tokenizer_builder import write_tokenizer_files

# Bump when the generated files change, so stale caches are regenerated.
GENERATOR_VERSION = 1
STAMP_FILE = "deepseek-pd-tiny.json"
TINY_NAMES = {"tiny": "v3", "tiny-v3": "v3", "tiny-v2": "v2"}
MAX_POSITIONS = 4096

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "torch_dtype": "float32",
}

_ARCH = {
    "v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 48,
        "n_shared_experts": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}


def tiny_config(arch: str, vocab_size: int) -> dict:
    if arch not in _ARCH:
        raise UserError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH)}")
    return {**_ARCH[arch], **_COMMON, "vocab_size": vocab_size}


def _tiny_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors. Scales keep activations O(1) so logits vary (std ~2): greedy output of
    random weights then wanders over the vocabulary instead of repeating one token."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def linear(name: str, out_features: int, in_features: int, gain: float = 1.0) -> None:
        std = gain / math.sqrt(in_features)
        tensors[name] = torch.randn(out_features, in_features, generator=gen) * std

    def norm(name: str, size: int) -> None:
        tensors[name] = 1.0 + 0.1 * torch.randn(size, generator=gen)

    def mlp(prefix: str, hidden: int, inner: int) -> None:
        linear(f"{prefix}.gate_proj.weight", inner, hidden)
        linear(f"{prefix}.up_proj.weight", inner, hidden)
        linear(f"{prefix}.down_proj.weight", hidden, inner, gain=0.5)

    hidden, vocab, heads = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    tensors["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    num_layers = config["num_hidden_layers"]

    def decoder_layer(layer: int) -> None:
        p = f"model.layers.{layer}"
        norm(f"{p}.input_layernorm.weight", hidden)
        if config["q_lora_rank"] is None:
            linear(f"{p}.self_attn.q_proj.weight", heads * qk_head, hidden)
        else:
            linear(f"{p}.self_attn.q_a_proj.weight", config["q_lora_rank"], hidden)
            norm(f"{p}.self_attn.q_a_layernorm.weight", config["q_lora_rank"])
            linear(f"{p}.self_attn.q_b_proj.weight", heads * qk_head, config["q_lora_rank"])
        linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", config["kv_lora_rank"] + config["qk_rope_head_dim"], hidden)
        norm(f"{p}.self_attn.kv_a_layernorm.weight", config["kv_lora_rank"])
        linear(f"{p}.self_attn.kv_b_proj.weight", heads * (config["qk_nope_head_dim"] + config["v_head_dim"]),
               config["kv_lora_rank"])
        linear(f"{p}.self_attn.o_proj.weight", hidden, heads * config["v_head_dim"], gain=0.5)
        norm(f"{p}.post_attention_layernorm.weight", hidden)
        if layer < config["first_k_dense_replace"]:
            mlp(f"{p}.mlp", hidden, config["intermediate_size"])
            return
        linear(f"{p}.mlp.gate.weight", config["n_routed_experts"], hidden, gain=2.0)
        if config["topk_method"] == "noaux_tc":
            tensors[f"{p}.mlp.gate.e_score_correction_bias"] = 0.05 * torch.randn(config["n_routed_experts"], generator=gen)
        for expert in range(config["n_routed_experts"]):
            mlp(f"{p}.mlp.experts.{expert}", hidden, config["moe_intermediate_size"])
        mlp(f"{p}.mlp.shared_experts", hidden, config["moe_intermediate_size"] * config["n_shared_experts"])

    for layer in range(num_layers):
        decoder_layer(layer)
    norm("model.norm.weight", hidden)
    linear("lm_head.weight", vocab, hidden, gain=2.0)
    for layer in range(num_layers, num_layers + config.get("num_nextn_predict_layers", 0)):
        # An MTP layer (model/speculative/mtp.py), from its own generator so the main weights keep their bytes.
        gen = torch.Generator().manual_seed(seed + 7919 * (layer + 1))  # noqa: F841 (read by the helpers)
        p = f"model.layers.{layer}"
        norm(f"{p}.enorm.weight", hidden)
        norm(f"{p}.hnorm.weight", hidden)
        linear(f"{p}.eh_proj.weight", hidden, 2 * hidden)
        norm(f"{p}.shared_head.norm.weight", hidden)
        decoder_layer(layer)
        # As DeepSeek-V3 ships them: copies of the shared embedding and head inside the MTP layer.
        tensors[f"{p}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{p}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return {name: t.to(torch.float32).contiguous() for name, t in tensors.items()}


def make_tiny_model(directory: str | Path, arch: str = "v3", seed: int = 0,
                    fp8_block: tuple[int, int] | None = None, mtp_layers: int = 0) -> Path:
    """Writes the tiny checkpoint into `directory` (created if needed); same arguments, same bytes.

    `fp8_block=(128, 128)` writes DeepSeek-V3's FP8 block-scaled format instead of fp32: linear
    weights as float8_e4m3fn plus `weight_scale_inv`, and a `quantization_config`.
    `mtp_layers=1` adds V3's multi-token-prediction layer after the decoder layers
    (`num_nextn_predict_layers`; model/speculative/mtp.py), random like the rest; the other weights are the
    same bytes as without it.
    """
    directory = Path(directory)
    if arch not in _ARCH:
        raise UserError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH)}")
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {directory}: {exc.strerror}") from None
    vocab_size = write_tokenizer_files(directory, max_length=MAX_POSITIONS)
    if mtp_layers not in (0, 1):
        raise UserError(f"mtp_layers must be 0 or 1 (DeepSeek-V3 ships one), got {mtp_layers}")
    config = tiny_config(arch, vocab_size)
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
    weights = _tiny_weights(config, seed)
    if fp8_block is not None:
        block = Fp8BlockQuantConfig.from_hf({"quant_method": "fp8", "weight_block_size": list(fp8_block)})
        weights = quantize_checkpoint(weights, block)
        config["quantization_config"] = hf_quantization_config(block)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    stamp = {"generator_version": GENERATOR_VERSION, "arch": arch, "seed": seed}
    (directory / STAMP_FILE).write_text(json.dumps(stamp) + "\n")
    return directory


def _is_current(directory: Path, arch: str) -> bool:
    try:
        stamp = json.loads((directory / STAMP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return stamp == {"generator_version": GENERATOR_VERSION, "arch": arch, "seed": 0}


def _ensure_cached_tiny(arch: str) -> Path:
    target = env.cache_dir() / f"tiny-{arch}"
    if _is_current(target, arch):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}-", dir=target.parent))
    try:
        make_tiny_model(staging, arch=arch, seed=0)
        if target.exists() and not _is_current(target, arch):
            # A stale generation: move it aside atomically, then delete it at leisure.
            stale = Path(tempfile.mkdtemp(prefix=f".stale-tiny-{arch}-", dir=target.parent))
            try:
                os.replace(target, stale / "old")
            except OSError:
                pass  # someone else replaced it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(staging, target)  # atomic; fails if another process got there first
        except OSError:
            if not _is_current(target, arch):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_model(arch: str = "v3") -> Path:
    """The cached tiny checkpoint's directory, generated on first use (what `model_dir.resolve_model_dir("tiny")` returns)."""
    if arch not in _ARCH:
        raise UserError(f"unknown tiny architecture {arch!r}; choose one of {sorted(_ARCH)}")
    return _ensure_cached_tiny(arch)
