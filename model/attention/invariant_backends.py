"""Attention backends for `--deterministic`: "torch_invariant" and "triton_invariant".

Prefill attention already reduces each query over its own sequence only (per-sequence loops in
torch, per-sequence programs in `flash_prefill`), and the chunked-prefix merge walks fixed prefix
chunks from position 0. What followed the batch is decode:
- torch: `mla_decode` pads every row to the batch's longest context, so a row's softmax and
  value sums run over a length the others set; here each row attends over its own length alone;
- Triton: `mla_decode` splits each sequence by the batch size; here every split is
  `INVARIANT_DECODE_TILE.split_len` positions of its own sequence (a fixed split size), merged in
  split order, for decode and for MLA extend alike.
Picked on CUDA (`RunnerConfig.invariant_kernels`); off CUDA the runner runs each sequence alone.
"""
from __future__ import annotations

import functools

import torch

from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS
from deepseek_pd.model.attention.torch_backend import TorchAttentionBackend, _softmax_attend
from deepseek_pd.model.attention.triton_backend import TritonAttentionBackend
from deepseek_pd.model.forward_batch import ForwardBatch


@ATTENTION_BACKENDS.register("torch_invariant")
class InvariantTorchAttentionBackend(TorchAttentionBackend):
    """The reference, with decode one row at a time over that row's own context."""

    device_lengths = False  # decode attends over each row's host length

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        page_size = kv_cache.shape[1]
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        out = q_latent.new_empty(q_latent.shape)
        for i, seq_len in enumerate(batch.seq_lens):
            key_pos = torch.arange(seq_len, device=flat.device)
            slots = batch.page_table[i, key_pos // page_size] * page_size + key_pos % page_size
            kv = flat[slots].float()  # [L, R+P]: this row's own keys only
            c_kv, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
            scores = (q_latent[i].float() @ c_kv.T + q_pe[i].float() @ k_pe.T) * scale  # [H, L]
            o, _ = _softmax_attend(scores, c_kv)
            out[i] = o.to(out.dtype)
        return out


@ATTENTION_BACKENDS.register("triton_invariant")
class InvariantTritonAttentionBackend(TritonAttentionBackend):
    """The Triton backend with decode (and MLA extend) split in fixed-length pieces."""

    def __init__(self) -> None:
        super().__init__()
        from deepseek_pd.model.kernels.mla_decode import INVARIANT_DECODE_TILE, mla_decode

        self._mla_decode = functools.partial(mla_decode, tile=INVARIANT_DECODE_TILE)
