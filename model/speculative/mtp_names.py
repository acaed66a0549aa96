"""Where the MTP module lives, by name: the one rule the loader, the weight mapping and the model share.

DeepSeek-V3 stores its multi-token-prediction module as checkpoint layer `num_hidden_layers`
(`model.layers.61.*`); our model holds it under `mtp.` (model/speculative/mtp.py), its decoder layer under
`mtp.layer.`, and its latent KV as the pool's layer `num_hidden_layers`.
"""
from __future__ import annotations

from typing import Protocol

MTP_PARAM_PREFIX = "mtp."
# HF names inside the MTP layer that copy the main model's tensors (shared, never loaded).
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
# A tensor every checkpoint with an MTP layer has (how its presence is checked at start-up).
MTP_MARKER = "eh_proj.weight"


class _HasLayers(Protocol):
    num_hidden_layers: int


def mtp_layer_id(config: _HasLayers) -> int:
    """The MTP module's layer index in the checkpoint and in the KV pool."""
    return config.num_hidden_layers


def mtp_hf_prefix(config: _HasLayers) -> str:
    return f"model.layers.{mtp_layer_id(config)}."


def kv_layers(config: _HasLayers, mtp: bool) -> int:
    """Layers of latent KV a pool holds: the decoder layers, and the MTP layer when it is loaded
    (speculative decoding). Its bytes per token, the PD layout and memory plans all follow this."""
    return config.num_hidden_layers + int(mtp)
