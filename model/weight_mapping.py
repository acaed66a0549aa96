"""HF checkpoint names → our fused parameters, streamed (each tensor is copied in as it arrives).

Every expected HF tensor is listed up front under its canonical name (per-expert form, as
`save_pretrained` writes). A name maps to one or more `(destination view, transform)` pairs:
    q_a_proj + kv_a_proj_with_mqa → rows of `fused_qkv_a_proj`        (when q_lora_rank is set)
    kv_b_proj `[H*(nope+v), R]`    → w_kc `[H, nope, R]` and w_vc `[H, v, R]`
    gate_proj / up_proj            → halves of `gate_up_proj` (dense MLP, shared experts) or `w13[j]`
    shared experts, when fused     → experts E..E+n-1, slices of width moe_intermediate_size
    with EP (ep_size W, rank r)      only routed experts r*E/W..(r+1)*E/W-1 are copied (local rows
                                   0..E/W-1, fused shared ones after them); the others' names are
                                   expected and skipped
HF's in-memory stacked form (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`)
is accepted too and counts for all its per-expert names. Layers >= num_hidden_layers (MTP) are
skipped. Anything left over raises `CheckpointError(missing, unexpected)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from deepseek_pd.errors import CheckpointError, UserError

if TYPE_CHECKING:
    from deepseek_pd.model.deepseek import DeepseekForCausalLM

Transform = Callable[[torch.Tensor], torch.Tensor]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Target:
    dest: torch.Tensor  # a view into a parameter
    transform: Transform | None = None


def _rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start:stop]


def _cols(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[:, start:stop]


def expected_targets(model: "DeepseekForCausalLM") -> tuple[dict[str, list[Target]], dict[str, list[str]]]:
    """(canonical HF name → targets, stacked alias → canonical names it stands for)."""
    cfg = model.config
    targets: dict[str, list[Target]] = {
        "model.embed_tokens.weight": [Target(model.embed_tokens.weight.data)],
        "model.norm.weight": [Target(model.norm.weight.data)],
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = [Target(model.lm_head.weight.data)]
    aliases: dict[str, list[str]] = {}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        targets[p + "input_layernorm.weight"] = [Target(layer.input_layernorm.weight.data)]
        targets[p + "post_attention_layernorm.weight"] = [Target(layer.post_attention_layernorm.weight.data)]
        a = p + "self_attn."
        if cfg.q_lora_rank is not None:
            fused = attn.fused_qkv_a_proj.weight.data
            targets[a + "q_a_proj.weight"] = [Target(fused[:cfg.q_lora_rank])]
            targets[a + "kv_a_proj_with_mqa.weight"] = [Target(fused[cfg.q_lora_rank:])]
            targets[a + "q_a_layernorm.weight"] = [Target(attn.q_a_layernorm.weight.data)]
            targets[a + "q_b_proj.weight"] = [Target(attn.q_b_proj.weight.data)]
        else:
            targets[a + "q_proj.weight"] = [Target(attn.q_proj.weight.data)]
            targets[a + "kv_a_proj_with_mqa.weight"] = [Target(attn.kv_a_proj_with_mqa.weight.data)]
        targets[a + "kv_a_layernorm.weight"] = [Target(attn.kv_a_layernorm.weight.data)]
        per_head = lambda t: t.reshape(heads, nope + v, -1)  # noqa: E731
        targets[a + "kv_b_proj.weight"] = [Target(attn.w_kc.data, lambda t: per_head(t)[:, :nope]),
                                           Target(attn.w_vc.data, lambda t: per_head(t)[:, nope:])]
        targets[a + "o_proj.weight"] = [Target(attn.o_proj.weight.data)]
        m = p + "mlp."
        if not layer.is_moe:
            _add_gated_mlp(targets, m, layer.mlp, cfg.intermediate_size)
            continue
        moe = layer.mlp
        targets[m + "gate.weight"] = [Target(moe.gate_weight.data)]
        if moe.e_score_correction_bias is not None:
            targets[m + "gate.e_score_correction_bias"] = [Target(moe.e_score_correction_bias.data)]
        inter = cfg.moe_intermediate_size
        w13, w2 = moe.experts.w13.data, moe.experts.w2.data
        placement = moe.placement
        for j in range(cfg.n_routed_experts):
            e = f"{m}experts.{j}."
            if not placement.is_local_routed(j):
                # Another EP rank's expert: expected in the checkpoint, copied nowhere here.
                for w in ("gate", "up", "down"):
                    targets[f"{e}{w}_proj.weight"] = []
                continue
            local = j - placement.first_local
            targets[e + "gate_proj.weight"] = [Target(w13[local, :inter])]
            targets[e + "up_proj.weight"] = [Target(w13[local, inter:])]
            targets[e + "down_proj.weight"] = [Target(w2[local])]
        aliases[m + "experts.gate_up_proj"] = [f"{m}experts.{j}.{w}_proj.weight"
                                               for j in range(cfg.n_routed_experts) for w in ("gate", "up")]
        aliases[m + "experts.down_proj"] = [f"{m}experts.{j}.down_proj.weight" for j in range(cfg.n_routed_experts)]
        if moe.shared_experts is not None:
            _add_gated_mlp(targets, m + "shared_experts.", moe.shared_experts, inter * cfg.n_shared_experts)
        elif moe.num_fused_shared:
            s = m + "shared_experts."
            targets[s + "gate_proj.weight"], targets[s + "up_proj.weight"], targets[s + "down_proj.weight"] = [], [], []
            for k in range(moe.num_fused_shared):
                j = placement.num_local_routed + k
                targets[s + "gate_proj.weight"].append(Target(w13[j, :inter], _rows(k * inter, (k + 1) * inter)))
                targets[s + "up_proj.weight"].append(Target(w13[j, inter:], _rows(k * inter, (k + 1) * inter)))
                targets[s + "down_proj.weight"].append(Target(w2[j], _cols(k * inter, (k + 1) * inter)))
    return targets, aliases


def _add_gated_mlp(targets: dict[str, list[Target]], prefix: str, mlp: torch.nn.Module, inter: int) -> None:
    gate_up = mlp.gate_up_proj.weight.data
    targets[prefix + "gate_proj.weight"] = [Target(gate_up[:inter])]
    targets[prefix + "up_proj.weight"] = [Target(gate_up[inter:])]
    targets[prefix + "down_proj.weight"] = [Target(mlp.down_proj.weight.data)]


def _copy(name: str, target: Target, tensor: torch.Tensor) -> None:
    src = tensor if target.transform is None else target.transform(tensor)
    if tuple(src.shape) != tuple(target.dest.shape):
        raise UserError(f"checkpoint tensor {name}: shape {tuple(tensor.shape)} does not fit "
                        f"the model (expected a slice of shape {tuple(target.dest.shape)})")
    target.dest.copy_(src)


def _skippable(name: str, tensor: torch.Tensor, num_layers: int, n_shared: int) -> bool:
    match = _LAYER.match(name)
    if match and int(match.group(1)) >= num_layers:
        return True  # MTP (next-n prediction) layers live after the decoder layers
    if name.endswith("rotary_emb.inv_freq"):
        return True  # recomputed from the config
    # HF builds a zero-width shared MLP when n_shared_experts is 0.
    return n_shared == 0 and ".shared_experts." in name and tensor.numel() == 0


def load_hf_weights(model: "DeepseekForCausalLM", weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    cfg = model.config
    targets, aliases = expected_targets(model)
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name in targets:
            for target in targets[name]:
                _copy(name, target, tensor)
            seen.add(name)
        elif name in aliases:
            _copy(name, _stacked_target(model, name), tensor)
            seen.update(aliases[name])
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied to the embedding
        elif not _skippable(name, tensor, cfg.num_hidden_layers, cfg.n_shared_experts):
            unexpected.append(name)
    missing = [name for name in targets if name not in seen]
    if missing or unexpected:
        raise CheckpointError(missing, unexpected, where="checkpoint does not match the model config")


def _stacked_target(model: "DeepseekForCausalLM", alias: str) -> Target:
    """HF's stacked `[E, ...]` expert tensor → this rank's block of routed experts."""
    layer = int(_LAYER.match(alias).group(1))
    moe = model.layers[layer].mlp
    first, n = moe.placement.first_local, moe.placement.num_local_routed
    dest = moe.experts.w13.data[:n] if alias.endswith("gate_up_proj") else moe.experts.w2.data[:n]
    total = model.config.n_routed_experts

    def local_block(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] != total:
            raise UserError(f"checkpoint tensor {alias}: {t.shape[0]} stacked experts, the config has {total}")
        return t[first:first + n]
    return Target(dest, local_block)
