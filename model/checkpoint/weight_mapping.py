"""HF checkpoint names → our fused parameters, streamed (each tensor is copied in as it arrives).

Every expected HF tensor is listed up front under its canonical name (per-expert form, as
`save_pretrained` writes). A name maps to one or more `(destination view, transform)` pairs:
    q_a_proj + kv_a_proj_with_mqa → rows of `fused_qkv_a_proj`        (when q_lora_rank is set)
    kv_b_proj `[H*(nope+v), R]`    → w_kc `[H, nope, R]` and w_vc `[H, v, R]`
    with attention TP (tp_size T, rank t; heads h = t*H/T .. (t+1)*H/T - 1): q_b_proj (q_proj)
                                   rows of heads h, kv_b_proj's heads h, o_proj's input columns
                                   of heads h (RowSlice / ColSlice: FP8 scales follow); the rest
                                   is replicated
    gate_proj / up_proj            → halves of `gate_up_proj` (dense MLP, shared experts) or `w13[j]`
    shared experts, when fused     → experts E..E+n-1, slices of width moe_intermediate_size
    with EP (ep_size W, rank r)      only routed expert slots r*S..(r+1)*S-1 (S = slots / W) are
                                   filled (local rows 0..S-1, fused shared ones after them); the
                                   others' names are expected and skipped
    redundant experts              slot p gets a copy of logical expert `location.row(l)[p]`, so
                                   one HF expert may fill several local rows (placement.local_logical)
HF's in-memory stacked form (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`)
is accepted too and counts for all its per-expert names (not in FP8). FP8 checkpoint tensors and their
`_scale_inv` are kept in FP8 or dequantised by `fp8_loading.Fp8Streams`. Layers >= num_hidden_layers (MTP) are
skipped, unless the model has its MTP module (`mtp.*` parameters): then layer num_hidden_layers fills
`mtp.layer.*` like a decoder layer, plus its enorm, hnorm, eh_proj and shared_head.norm (its copies of
the embedding and lm_head are skipped: the main model's are shared). Anything left over raises
`CheckpointError(missing, unexpected)`.

The mapping is a pure function over names and tensors: it sees the model only as its parameters
by name (`dict(model.named_parameters())`, e.g. `layers.3.mlp.experts.w13`), the `ModelConfig` and
the rank's `ExpertPlacement`, so it knows nothing of the module classes. The layer structure comes
from the config (`is_moe_layer`, `q_lora_rank`); what depends on build options comes from the
parameters present (`e_score_correction_bias`, an unfused `shared_experts` MLP) and the placement.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from deepseek_pd.errors import CheckpointError, UserError
from deepseek_pd.model.attention.tensor_parallel import local_heads
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.quant.fp8_loading import ColSlice, Fp8Streams, RowSlice, is_fp8_tensor
from deepseek_pd.model.speculative.mtp_names import MTP_PARAM_PREFIX, mtp_layer_id
from deepseek_pd.model.distributed.parallel import ExpertPlacement

Transform = Callable[[torch.Tensor], torch.Tensor]
Params = Mapping[str, torch.Tensor]  # our parameter name → parameter (`named_parameters()`)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Target:
    dest: torch.Tensor  # a view into a parameter
    transform: Transform | None = None


_rows, _cols = RowSlice, ColSlice  # slices FP8 loading can follow (fp8_loading.py)


def _param(params: Params, name: str) -> torch.Tensor:
    """The parameter's data (copied into without autograd); a name the model lacks is a mapping bug."""
    try:
        return params[name].data
    except KeyError:
        raise KeyError(f"weight mapping: the model has no parameter {name!r}") from None


def expected_targets(config: ModelConfig, placement: ExpertPlacement,
                     params: Params) -> tuple[dict[str, list[Target]], dict[str, list[str]]]:
    """(canonical HF name → targets, stacked alias → canonical names it stands for)."""
    cfg = config
    targets: dict[str, list[Target]] = {
        "model.embed_tokens.weight": [Target(_param(params, "embed_tokens.weight"))],
        "model.norm.weight": [Target(_param(params, "norm.weight"))],
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = [Target(_param(params, "lm_head.weight"))]
    aliases: dict[str, list[str]] = {}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    mine = local_heads(heads, placement.parallel)  # this TP rank's heads (all of them at tp 1)
    tp = placement.parallel.tp_size > 1
    q_rows = _rows(mine.start * cfg.qk_head_dim, mine.stop * cfg.qk_head_dim) if tp else None
    o_cols = _cols(mine.start * v, mine.stop * v) if tp else None
    for i in range(cfg.num_hidden_layers + _has_mtp(params)):
        p, ours = f"model.layers.{i}.", _our_layer_prefix(cfg, i)
        targets[p + "input_layernorm.weight"] = [Target(_param(params, ours + "input_layernorm.weight"))]
        targets[p + "post_attention_layernorm.weight"] = [
            Target(_param(params, ours + "post_attention_layernorm.weight"))]
        a, attn = p + "self_attn.", ours + "self_attn."
        if cfg.q_lora_rank is not None:
            fused = _param(params, attn + "fused_qkv_a_proj.weight")
            targets[a + "q_a_proj.weight"] = [Target(fused[:cfg.q_lora_rank])]
            targets[a + "kv_a_proj_with_mqa.weight"] = [Target(fused[cfg.q_lora_rank:])]
            targets[a + "q_a_layernorm.weight"] = [Target(_param(params, attn + "q_a_layernorm.weight"))]
            targets[a + "q_b_proj.weight"] = [Target(_param(params, attn + "q_b_proj.weight"), q_rows)]
        else:
            targets[a + "q_proj.weight"] = [Target(_param(params, attn + "q_proj.weight"), q_rows)]
            targets[a + "kv_a_proj_with_mqa.weight"] = [Target(_param(params, attn + "kv_a_proj_with_mqa.weight"))]
        targets[a + "kv_a_layernorm.weight"] = [Target(_param(params, attn + "kv_a_layernorm.weight"))]
        per_head = lambda t: t.reshape(heads, nope + v, -1)[mine.start:mine.stop]  # noqa: E731
        targets[a + "kv_b_proj.weight"] = [Target(_param(params, attn + "w_kc"), lambda t: per_head(t)[:, :nope]),
                                           Target(_param(params, attn + "w_vc"), lambda t: per_head(t)[:, nope:])]
        targets[a + "o_proj.weight"] = [Target(_param(params, attn + "o_proj.weight"), o_cols)]
        m, mlp = p + "mlp.", ours + "mlp."
        if not cfg.is_moe_layer(i):
            _add_gated_mlp(targets, m, params, mlp, cfg.intermediate_size)
            continue
        targets[m + "gate.weight"] = [Target(_param(params, mlp + "gate_weight"))]
        if mlp + "e_score_correction_bias" in params:
            targets[m + "gate.e_score_correction_bias"] = [Target(_param(params, mlp + "e_score_correction_bias"))]
        inter = cfg.moe_intermediate_size
        w13, w2 = _param(params, mlp + "experts.w13"), _param(params, mlp + "experts.w2")
        slots_of: dict[int, list[int]] = {}  # logical expert -> this rank's slots holding it
        for local, logical in enumerate(placement.local_logical(i)):
            slots_of.setdefault(logical, []).append(local)
        for j in range(cfg.n_routed_experts):
            # Each local replica gets a copy; an expert only other ranks hold is expected in the
            # checkpoint and copied nowhere here (no targets).
            e, slots = f"{m}experts.{j}.", slots_of.get(j, [])
            targets[e + "gate_proj.weight"] = [Target(w13[s, :inter]) for s in slots]
            targets[e + "up_proj.weight"] = [Target(w13[s, inter:]) for s in slots]
            targets[e + "down_proj.weight"] = [Target(w2[s]) for s in slots]
        aliases[m + "experts.gate_up_proj"] = [f"{m}experts.{j}.{w}_proj.weight"
                                               for j in range(cfg.n_routed_experts) for w in ("gate", "up")]
        aliases[m + "experts.down_proj"] = [f"{m}experts.{j}.down_proj.weight" for j in range(cfg.n_routed_experts)]
        if mlp + "shared_experts.gate_up_proj.weight" in params:
            _add_gated_mlp(targets, m + "shared_experts.", params, mlp + "shared_experts.", inter * cfg.n_shared_experts)
        elif placement.num_fused_shared:
            s = m + "shared_experts."
            targets[s + "gate_proj.weight"], targets[s + "up_proj.weight"], targets[s + "down_proj.weight"] = [], [], []
            for k in range(placement.num_fused_shared):
                j = placement.num_local_routed + k
                targets[s + "gate_proj.weight"].append(Target(w13[j, :inter], _rows(k * inter, (k + 1) * inter)))
                targets[s + "up_proj.weight"].append(Target(w13[j, inter:], _rows(k * inter, (k + 1) * inter)))
                targets[s + "down_proj.weight"].append(Target(w2[j], _cols(k * inter, (k + 1) * inter)))
    if _has_mtp(params):
        _add_mtp_head(targets, cfg, params)
    return targets, aliases


def _has_mtp(params: Params) -> bool:
    """The model was built with its MTP layer (model/speculative/mtp.py), whose checkpoint layer is then loaded."""
    return MTP_PARAM_PREFIX + "eh_proj.weight" in params


def _our_layer_prefix(cfg: ModelConfig, layer_id: int) -> str:
    """Our parameter prefix of checkpoint layer `layer_id`: a decoder layer, or the MTP module's."""
    return MTP_PARAM_PREFIX + "layer." if layer_id == mtp_layer_id(cfg) else f"layers.{layer_id}."


def _add_mtp_head(targets: dict[str, list[Target]], cfg: ModelConfig, params: Params) -> None:
    """The MTP module's own tensors around its decoder layer (its embedding and head are shared)."""
    p = f"model.layers.{mtp_layer_id(cfg)}."
    for hf, ours in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                     ("shared_head.norm", "shared_head_norm")):
        targets[f"{p}{hf}.weight"] = [Target(_param(params, f"{MTP_PARAM_PREFIX}{ours}.weight"))]


def _add_gated_mlp(targets: dict[str, list[Target]], prefix: str, params: Params, ours: str, inter: int) -> None:
    gate_up = _param(params, ours + "gate_up_proj.weight")
    targets[prefix + "gate_proj.weight"] = [Target(gate_up[:inter])]
    targets[prefix + "up_proj.weight"] = [Target(gate_up[inter:])]
    targets[prefix + "down_proj.weight"] = [Target(_param(params, ours + "down_proj.weight"))]


def _copy(name: str, target: Target, tensor: torch.Tensor) -> None:
    src = tensor if target.transform is None else target.transform(tensor)
    if is_fp8_tensor(target.dest) and not is_fp8_tensor(src):
        raise UserError(f"checkpoint tensor {name} is {src.dtype}, but the model keeps it in FP8 "
                        "(an FP8 checkpoint read with keep_fp8=True is needed)")
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


def load_hf_weights(config: ModelConfig, placement: ExpertPlacement, params: Params,
                    weights: Iterable[tuple[str, torch.Tensor]],
                    fp8_blocks: Mapping[str, Fp8BlockQuantConfig] | None = None) -> None:
    """Copies HF-named `weights` into `params` (ours, by name); raises CheckpointError listing
    missing/unexpected names, UserError on a tensor that does not fit.

    FP8 tensors (with their `_scale_inv` right after) go through `fp8_loading.Fp8Streams`: kept
    in FP8 where `fp8_blocks` (our FP8 parameter names → blocks) has their parameter, else
    dequantised."""
    cfg = config
    targets, aliases = expected_targets(config, placement, params)
    block = cfg.quantization and cfg.quantization.get("weight_block_size")
    fp8 = Fp8Streams(params, fp8_blocks or {}, Fp8BlockQuantConfig(*block) if block else None)
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if is_fp8_tensor(tensor) and name in targets:
            fp8.weight(name, tensor, targets[name], _copy)
        elif fp8.expects(name):
            seen.add(fp8.scale(name, tensor, _copy))
        elif is_fp8_tensor(tensor) and name in aliases:
            raise UserError(f"checkpoint tensor {name}: stacked FP8 experts are not supported (per-expert FP8 is)")
        elif name in targets:
            for target in targets[name]:
                _copy(name, target, tensor)
            seen.add(name)
        elif name in aliases:
            _copy(name, _stacked_target(config, placement, params, name), tensor)
            seen.update(aliases[name])
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied to the embedding
        elif not _skippable(name, tensor, cfg.num_hidden_layers, cfg.n_shared_experts):
            unexpected.append(name)
    fp8.check_complete()
    missing = [name for name in targets if name not in seen]
    if missing or unexpected:
        raise CheckpointError(missing, unexpected, where="checkpoint does not match the model config")


def _stacked_target(config: ModelConfig, placement: ExpertPlacement, params: Params, alias: str) -> Target:
    """HF's stacked `[E, ...]` expert tensor → the logical experts of this rank's routed slots."""
    layer_id = int(_LAYER.match(alias).group(1))
    experts = _our_layer_prefix(config, layer_id) + "mlp.experts."
    logical = torch.tensor(placement.local_logical(layer_id), dtype=torch.long)
    dest = _param(params, experts + ("w13" if alias.endswith("gate_up_proj") else "w2"))[:len(logical)]
    total = config.n_routed_experts

    def local_slots(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] != total:
            raise UserError(f"checkpoint tensor {alias}: {t.shape[0]} stacked experts, the config has {total}")
        return t.index_select(0, logical.to(t.device))
    return Target(dest, local_slots)
