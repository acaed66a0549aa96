"""`ModelConfig`: the frozen, validated shape of a DeepSeek-V2 / V2-Lite / V3 / R1 model.

Built once from a HF `config.json` (a path, a directory or an already-parsed dict) by
`ModelConfig.from_hf`. Every field the model math needs is normalised here, so no other module
reads raw config dicts. Unsupported values raise `UserError` naming the field; unknown keys are
ignored (HF configs carry many fields that do not change the math).

Example: DeepSeek-V2-Lite has `q_lora_rank: null`, `topk_method: "greedy"`, softmax scoring and
`rope_scaling: {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, ...}`;
`ModelConfig.from_hf(path).softmax_scale` is `192 ** -0.5 * yarn_mscale(40, 0.707) ** 2`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from deepseek_pd.errors import UserError
from deepseek_pd.model.checkpoint.model_dir import read_json

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")
_MISSING = object()


# Bytes per element of each dtype a checkpoint (torch_dtype) or `--dtype` may name. Torch-free, as
# this whole module: the operator and `bench serving` size KV without importing torch.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# What `--dtype` (RunnerConfig.dtype) may be: one of those, or "auto" (the checkpoint's); `serve`'s
# parser (workers/serve/flags.py) offers these and `RunnerConfig` refuses anything else.
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)


def latent_kv_bytes(num_layers: int, kv_dim: int, itemsize: int, tokens: int = 1) -> int:
    """Bytes of latent KV that `tokens` tokens take over all layers (ARCHITECTURE §3): each layer
    holds `kv_dim` (= kv_lora_rank + qk_rope_head_dim) values of `itemsize` bytes per token.

    The one rule for it: the KV pool, the worker's reported identity, the operator's memory plan
    and `bench serving` all call this. V2-Lite in bf16: latent_kv_bytes(27, 576, 2) == 31104.
    """
    return num_layers * kv_dim * itemsize * tokens

def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, exactly as HF `yarn_get_mscale`."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the `qk_rope_head_dim` part of q and k.

    `rope_type` "default" uses plain `theta`; "yarn" blends interpolated and extrapolated
    frequencies between `beta_fast` and `beta_slow` rotations and scales cos/sin by
    `attention_factor` (HF's rule: mscale/mscale_all_dim ratio when both are set).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0 means "not given", as HF treats a falsy value
    mscale_all_dim: float = 0.0
    attention_factor_override: float | None = None
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """Multiplier HF applies to cos and sin (so to both q_pe and k_pe)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor_override is not None:
            return self.attention_factor_override
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale_sq(self) -> float:
        """Extra softmax-scale factor (mscale_all_dim squared), as HF `yarn_apply_mscale`."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


@dataclass(frozen=True)
class ModelConfig:
    """Everything the DeepSeek model math depends on. Derived values are properties."""

    architectures: tuple[str, ...]
    model_type: str  # "deepseek_v2" | "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    topk_method: str
    scoring_func: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    quantization: Mapping[str, Any] | None  # e.g. {"quant_method": "fp8", "weight_block_size": (128, 128)}

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one token's latent KV slot: normalised c_kv then roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Latent KV bytes of one token over all layers in `dtype` (default: the checkpoint's)."""
        return latent_kv_bytes(self.num_hidden_layers, self.kv_cache_dim, DTYPE_BYTES[dtype or self.torch_dtype])

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale_sq

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def is_fp8(self) -> bool:
        return bool(self.quantization) and self.quantization.get("quant_method") == "fp8"

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: dense for the first k layers, then MoE every `moe_layer_freq` layers."""
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | Mapping[str, Any]) -> "ModelConfig":
        """Parse a HF DeepSeek config (path to config.json, a model directory, or a dict)."""
        raw = _read(source)
        return _Parser(raw).build()


def _read(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    return read_json(path) if path.is_dir() else read_json(path.parent, path.name)


class _Parser:
    """Typed field access over a raw dict; every error names the field."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def get(self, name: str, kind: type, default: Any = _MISSING, *, nullable: bool = False,
            src: Mapping[str, Any] | None = None, prefix: str = "") -> Any:
        src = self.raw if src is None else src
        value = src.get(name, default)
        label = f"{prefix}{name}"
        if value is _MISSING:
            raise UserError(f"model config: required field '{label}' is missing")
        if value is None:
            if nullable or default is None:
                return None
            raise UserError(f"model config: field '{label}' must not be null")
        return _coerce(label, value, kind)

    def positive(self, name: str, default: Any = _MISSING, **kw: Any) -> int:
        value = self.get(name, int, default, **kw)
        if value is not None and value < 1:
            raise UserError(f"model config: field '{name}' must be >= 1, got {value}")
        return value

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.get(name, str, default)
        if value not in allowed:
            raise UserError(f"model config: field '{name}'={value!r} is not supported (one of {allowed})")
        return value

    def build(self) -> ModelConfig:
        r = self.raw
        model_type = self.get("model_type", str, "deepseek_v3")
        if model_type not in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
            raise UserError(f"model config: field 'model_type'={model_type!r} is not a DeepSeek-V2/V3 model")
        is_v3 = model_type != "deepseek_v2"
        for flag in ("attention_bias", "mlp_bias"):
            if self.get(flag, bool, False):
                raise UserError(f"model config: field '{flag}'=true is not supported (no DeepSeek model uses it)")
        act = self.get("hidden_act", str, "silu")
        if act != "silu":
            raise UserError(f"model config: field 'hidden_act'={act!r} is not supported (only 'silu')")

        heads = self.positive("num_attention_heads")
        n_routed = self.get("n_routed_experts", int, 0, nullable=True) or 0
        top_k = self.get("num_experts_per_tok", int, None, nullable=True) or 0
        n_group = self.get("n_group", int, None, nullable=True) or 1
        topk_group = self.get("topk_group", int, None, nullable=True) or n_group
        cfg = ModelConfig(
            architectures=tuple(self.get("architectures", list, None, nullable=True) or ()),
            model_type=model_type,
            vocab_size=self.positive("vocab_size"),
            hidden_size=self.positive("hidden_size"),
            intermediate_size=self.positive("intermediate_size"),
            moe_intermediate_size=(self.positive("moe_intermediate_size") if n_routed
                                   else self.get("moe_intermediate_size", int, 0, nullable=True) or 0),
            num_hidden_layers=self.positive("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=self.get("num_key_value_heads", int, heads, nullable=True) or heads,
            q_lora_rank=self.get("q_lora_rank", int, None, nullable=True) or None,
            kv_lora_rank=self.positive("kv_lora_rank"),
            qk_nope_head_dim=self.positive("qk_nope_head_dim"),
            qk_rope_head_dim=self.positive("qk_rope_head_dim"),
            v_head_dim=self.positive("v_head_dim"),
            n_routed_experts=n_routed,
            n_shared_experts=self.get("n_shared_experts", int, 0, nullable=True) or 0,
            num_experts_per_tok=top_k,
            topk_method=self.choice("topk_method", TOPK_METHODS, "noaux_tc" if is_v3 else "greedy"),
            scoring_func=self.choice("scoring_func", SCORING_FUNCS, "sigmoid" if is_v3 else "softmax"),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=self.get("norm_topk_prob", bool, is_v3, nullable=True) or False,
            routed_scaling_factor=self.get("routed_scaling_factor", float, 1.0, nullable=True) or 1.0,
            first_k_dense_replace=self.get("first_k_dense_replace", int, 0, nullable=True) or 0,
            moe_layer_freq=self.positive("moe_layer_freq", 1),
            rms_norm_eps=self.get("rms_norm_eps", float, 1e-6),
            rope=self._rope(),
            # V2 always rotates interleaved pairs (complex form); V3 has a switch, on by default.
            rope_interleave=self.get("rope_interleave", bool, True) if is_v3 else True,
            max_position_embeddings=self.positive("max_position_embeddings", 4096),
            num_nextn_predict_layers=self.get("num_nextn_predict_layers", int, 0, nullable=True) or 0,
            tie_word_embeddings=self.get("tie_word_embeddings", bool, False, nullable=True) or False,
            bos_token_id=self.get("bos_token_id", int, None, nullable=True),
            eos_token_ids=self._eos(),
            torch_dtype=self._dtype(),
            quantization=self._quantization(),
        )
        _check_consistency(cfg)
        return cfg

    def _eos(self) -> tuple[int, ...]:
        value = self.raw.get("eos_token_id")
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        return tuple(_coerce("eos_token_id", v, int) for v in values)

    def _dtype(self) -> str:
        value = self.raw.get("torch_dtype", self.raw.get("dtype", "bfloat16")) or "bfloat16"
        value = str(value).removeprefix("torch.")
        if value not in DTYPE_BYTES:
            raise UserError(f"model config: field 'torch_dtype'={value!r} is not supported")
        return value

    def _quantization(self) -> Mapping[str, Any] | None:
        q = self.raw.get("quantization_config")
        if not q:
            return None
        if not isinstance(q, Mapping):
            raise UserError("model config: field 'quantization_config' must be an object")
        method = q.get("quant_method")
        if method != "fp8":
            raise UserError(f"model config: field 'quantization_config.quant_method'={method!r} "
                            "is not supported (only 'fp8')")
        block = tuple(q.get("weight_block_size") or (128, 128))
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise UserError(f"model config: field 'quantization_config.weight_block_size'={block!r} is invalid")
        return {"quant_method": "fp8", "fmt": q.get("fmt", "e4m3"), "weight_block_size": block,
                "activation_scheme": q.get("activation_scheme", "dynamic")}

    def _rope(self) -> RopeConfig:
        # Newer HF writes `rope_parameters` (with rope_theta inside); older `rope_scaling` + top-level theta.
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        field = "rope_parameters" if self.raw.get("rope_parameters") else "rope_scaling"
        if not isinstance(params, Mapping):
            raise UserError(f"model config: field '{field}' must be an object")
        pre = f"{field}."
        theta = self.get("rope_theta", float, self.raw.get("rope_theta", 10000.0), src=params, prefix=pre)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise UserError(f"model config: field '{pre}rope_type'={rope_type!r} is not supported "
                            f"(one of {ROPE_TYPES})")
        if rope_type == "default":
            return RopeConfig(theta=theta)
        max_pos = self.get("max_position_embeddings", int, 4096)
        original = self.get("original_max_position_embeddings", int, max_pos, src=params, prefix=pre)
        factor = self.get("factor", float, None, src=params, prefix=pre, nullable=True)
        if factor is None:  # HF: V3-style configs may leave it to the ratio of lengths
            factor = max_pos / original
        return RopeConfig(
            rope_type="yarn", theta=theta, factor=factor, original_max_position_embeddings=original,
            beta_fast=self.get("beta_fast", float, None, src=params, prefix=pre, nullable=True) or 32.0,
            beta_slow=self.get("beta_slow", float, None, src=params, prefix=pre, nullable=True) or 1.0,
            mscale=self.get("mscale", float, None, src=params, prefix=pre, nullable=True) or 0.0,
            mscale_all_dim=self.get("mscale_all_dim", float, None, src=params, prefix=pre, nullable=True) or 0.0,
            attention_factor_override=self.get("attention_factor", float, None, src=params, prefix=pre,
                                               nullable=True),
            truncate=self.get("truncate", bool, True, src=params, prefix=pre),
        )


def _coerce(label: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise UserError(f"model config: field '{label}' must be {kind.__name__}, got {value!r}")
    return value


def _check_consistency(cfg: ModelConfig) -> None:
    def bad(field: str, why: str) -> UserError:
        return UserError(f"model config: field '{field}' {why}")

    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise bad("num_key_value_heads", "must equal num_attention_heads for MLA")
    if cfg.n_routed_experts:
        if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise bad("num_experts_per_tok", f"must be in [1, n_routed_experts={cfg.n_routed_experts}]")
        if cfg.n_routed_experts % cfg.n_group:
            raise bad("n_group", f"must divide n_routed_experts={cfg.n_routed_experts}")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            raise bad("topk_group", f"must be in [1, n_group={cfg.n_group}]")
        if cfg.topk_method == "noaux_tc" and cfg.n_routed_experts // cfg.n_group < 2:
            raise bad("n_group", "leaves fewer than 2 experts per group (noaux_tc sums the top 2)")
        if cfg.topk_method != "greedy" and cfg.num_experts_per_tok > cfg.topk_group * (
                cfg.n_routed_experts // cfg.n_group):
            raise bad("num_experts_per_tok", "exceeds the experts in the selected groups")
    if cfg.first_k_dense_replace < 0:
        raise bad("first_k_dense_replace", "must be >= 0")
    if cfg.rope.rope_type == "yarn" and cfg.rope.factor <= 0:
        raise bad("rope_scaling.factor", "must be > 0")
    if cfg.qk_rope_head_dim % 2:
        raise bad("qk_rope_head_dim", "must be even")
