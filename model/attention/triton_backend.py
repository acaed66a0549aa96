"""Attention backend "triton": Triton kernels for MHA prefill and MLA decode.

    mha_causal / mha_cross  `kernels/flash_prefill.py`: one ragged flash-attention launch for the
                            whole batch, returning the log-sum-exp the chunked-prefix path merges.
    mla_decode              `kernels/mla_decode.py`: all sequences in one split-K launch over a
                            `[batch, max_pages]` int32 page table built once per batch (shared by
                            all layers through `batch.derived`).
    mla_extend              the same kernel with one row per new token: the token at position p
                            reads its sequence's pages up to p (a `[tokens, max_pages]` table and
                            `positions + 1` as lengths, built once per batch). It re-reads the
                            cache per token, which is cheap for the short prefixes the policy
                            sends here (long ones go to MHA_CHUNKED_KV).
    merge_states            `kernels/merge_states.py`: one launch per prefix chunk.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS, QK, RopeSplit, joined
from deepseek_pd.model.forward_batch import ForwardBatch
from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kernels.checks import require_triton

_DECODE_META = "triton_decode_meta"
_EXTEND_META = "triton_extend_meta"


def decode_metadata(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(page_table int32, seq_lens int32, host max seq len), built once per batch."""
    if _DECODE_META not in batch.derived:
        batch.derived[_DECODE_META] = (batch.page_table.to(torch.int32).contiguous(),
                                       batch.seq_lens_t.to(torch.int32).contiguous(), max(batch.seq_lens))
    return batch.derived[_DECODE_META]


def extend_metadata(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per new token: (its sequence's page table row int32, position + 1 int32, host max length)."""
    if _EXTEND_META not in batch.derived:
        table, _, max_len = decode_metadata(batch)
        batch.derived[_EXTEND_META] = (table.index_select(0, batch.token_seq).contiguous(),
                                       (batch.positions + 1).to(torch.int32).contiguous(), max_len)
    return batch.derived[_EXTEND_META]


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels take any row strides but need a unit stride along the feature axis."""
    return t if t.stride(-1) == 1 else t.contiguous()


@ATTENTION_BACKENDS.register("triton")
class TritonAttentionBackend:
    # Decode has no host sync; the split count follows host lengths, fixed per capture (cuda_graph.py).
    cuda_graph_safe = True
    device_lengths = True  # the kernels read positions + 1 / seq_lens; host lengths size the grid

    def __init__(self) -> None:
        require_triton("attention backend 'triton'")
        from deepseek_pd.model.kernels.flash_prefill import flash_attention, rope_split_fits
        from deepseek_pd.model.kernels.merge_states import merge_states
        from deepseek_pd.model.kernels.mla_decode import mla_decode

        self._flash = flash_attention
        self._rope_split_fits = rope_split_fits
        self._mla_decode = mla_decode
        self._merge = merge_states

    # The last offsets uploaded by ANY layer's backend, with the very tuple they came from: a batch's
    # `qo_offsets` is one tuple object that every layer passes, so one upload serves the whole
    # forward (each upload is a pinned block and a copy launch, ~27 of them per extend of V2-Lite;
    # host time is what a short extend is bound by). Keyed by identity, not value: a new batch's
    # tuple never hits, so no layer reads a copy queued on another batch's stream. One pair,
    # replaced at once, so threads that forward side by side each see a whole pair.
    _shared_offsets: tuple[tuple[int, ...], torch.device, torch.Tensor] | None = None

    def _device_offsets(self, offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
        last = TritonAttentionBackend._shared_offsets
        if last is not None and last[0] is offsets and last[1] == device:
            return last[2]
        uploaded = upload(torch.tensor(offsets, dtype=torch.int32), device)
        TritonAttentionBackend._shared_offsets = (offsets, device, uploaded)
        return uploaded

    def _qk(self, q: QK, k: QK) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The kernel's q and k, and their rope parts where it reads them apart (the same bits as
        joined, without the concatenation: `flash_prefill.rope_split_fits`)."""
        if isinstance(q, RopeSplit) and isinstance(k, RopeSplit) \
                and self._rope_split_fits(q.nope.shape[-1], q.rope.shape[-1]):
            return _unit_stride(q.nope), _unit_stride(k.nope), {"q_rope": _unit_stride(q.rope),
                                                                "k_rope": _unit_stride(k.rope)}
        return _unit_stride(joined(q)), _unit_stride(joined(k)), {}

    def mha_causal(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, rope = self._qk(q, k)
        offsets = self._device_offsets(qo_offsets, q.device)
        max_len = max(b - a for a, b in zip(qo_offsets[:-1], qo_offsets[1:]))
        return self._flash(q, k, _unit_stride(v), offsets, offsets, max_len, scale, causal=True, **rope)

    def mha_cross(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                  kv_offsets: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, rope = self._qk(q, k)
        q_dev = self._device_offsets(qo_offsets, q.device)
        kv_dev = upload(torch.tensor(kv_offsets, dtype=torch.int32), q.device)
        max_len = max(b - a for a, b in zip(qo_offsets[:-1], qo_offsets[1:]))
        return self._flash(q, k, _unit_stride(v), q_dev, kv_dev, max_len, scale, causal=False, **rope)

    def merge_states(self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._merge(_unit_stride(out_a), _unit_stride(lse_a), _unit_stride(out_b), _unit_stride(lse_b))

    def mla_extend(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        check_latent_rank(q_latent, q_pe, kv_cache, kv_lora_rank)
        page_table, lengths, max_len = extend_metadata(batch)
        return self._mla_decode(_unit_stride(q_latent), _unit_stride(q_pe), kv_cache, page_table, lengths,
                                max_len, scale)

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        check_latent_rank(q_latent, q_pe, kv_cache, kv_lora_rank)
        page_table, seq_lens, max_len = decode_metadata(batch)
        return self._mla_decode(_unit_stride(q_latent), _unit_stride(q_pe), kv_cache, page_table, seq_lens,
                                max_len, scale)


def check_latent_rank(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    if kv_cache.shape[-1] != kv_lora_rank + q_pe.shape[-1] or q_latent.shape[-1] != kv_lora_rank:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} does not fit q_latent {tuple(q_latent.shape)} / "
                         f"kv_cache {tuple(kv_cache.shape)}")
