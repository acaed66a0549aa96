"""MLA attention: the layer (`mla`), the method policy (`policy`), kernel backends (`backend`, registry).

Importing the package registers the plain-torch reference backend ("torch"), "triton"
(built only where Triton can run), "flashinfer" (built only where FlashInfer imports on a Hopper GPU)
and "flashmla" (built only where FlashMLA imports on a Hopper GPU and passes its start-up check).
"""
from deepseek_pd.model.attention import torch_backend  # noqa: F401  (registers "torch")
from deepseek_pd.model.attention import triton_backend  # noqa: F401  (registers "triton")
from deepseek_pd.model.attention import flashinfer_backend  # noqa: F401  (registers "flashinfer")
from deepseek_pd.model.attention import flashmla_backend  # noqa: F401  (registers "flashmla")
from deepseek_pd.model.attention import invariant_backends  # noqa: F401  (registers "*_invariant")
from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS, AttentionBackend
from deepseek_pd.model.attention.mla import MLAAttention
from deepseek_pd.model.attention.policy import ATTENTION_METHOD_CHOICES, AttentionPolicy

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_METHOD_CHOICES", "AttentionBackend", "AttentionPolicy", "MLAAttention"]
