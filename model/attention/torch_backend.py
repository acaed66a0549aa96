"""Plain-torch attention kernels: the reference every faster backend is tested against.

Math is done in fp32 whatever the model dtype, outputs are cast back to the query dtype (lse stays
fp32). Loops run over sequences (host lengths, no device sync); decode is fully batched.

Masks select, they never multiply: a masked score is replaced by -inf and its probability by 0,
and a position that is not the row's (padding, past its length) is never gathered: the row's own
first token is read in its place. `0 * NaN` is NaN, so a multiplied mask would let a NaN in memory
the row merely gathered (another request's unchecked KV, a stale page) into its output.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.attention.backend import ATTENTION_BACKENDS, QK, joined
from deepseek_pd.model.forward_batch import ForwardBatch


def _softmax_attend(scores: torch.Tensor, values: torch.Tensor,
                    visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores `[..., H, Q, K]` fp32, values `[..., H, K, Dv]`, visible (broadcast to scores; None:
    all) → out `[..., H, Q, Dv]`, lse. Hidden scores are selected away (-inf, probability 0), so
    whatever they held, NaN included, cannot reach the output; values at keys hidden from every
    query must be finite (the callers gather only the row's own KV there)."""
    if visible is not None:
        scores = torch.where(visible, scores, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    # Hidden keys, and every key of a row that sees none (exp(-inf - -inf) is NaN): exactly 0.
    probs = torch.where(scores == float("-inf"), 0.0, probs)
    return probs @ values, lse


def _tiles(start: int, end: int, tile: int):
    """Query tiles [s, e) of one sequence, so scores stay `[H, tile, keys]` however long it is."""
    for s in range(start, end, tile):
        yield s, min(end, s + tile)


@ATTENTION_BACKENDS.register("torch")
class TorchAttentionBackend:
    """Reference kernels, correct on any device; not fast. Queries are processed in tiles."""

    cuda_graph_safe = False  # the reference; decode gathers the whole captured context per step
    device_lengths = True  # keys past a row's device length are gathered from its first and masked

    def __init__(self, query_tile: int = 1024) -> None:
        self.query_tile = query_tile

    def mha_causal(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = joined(q), joined(k)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        for seq_start, seq_end in zip(qo_offsets[:-1], qo_offsets[1:]):
            for start, end in _tiles(seq_start, seq_end, self.query_tile):
                qs = q[start:end].float().transpose(0, 1)  # [H, t, D]
                ks = k[seq_start:end].float().transpose(0, 1)  # keys up to the tile's last query
                vs = v[seq_start:end].float().transpose(0, 1)
                scores = (qs @ ks.transpose(1, 2)) * scale
                q_idx = torch.arange(start - seq_start, end - seq_start, device=q.device)
                k_idx = torch.arange(end - seq_start, device=q.device)
                o, l = _softmax_attend(scores, vs, k_idx[None, :] <= q_idx[:, None])
                out[start:end] = o.transpose(0, 1).to(out.dtype)
                lse[start:end] = l.transpose(0, 1)
        return out, lse

    def mha_cross(self, q: QK, k: QK, v: torch.Tensor, qo_offsets: tuple[int, ...],
                  kv_offsets: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = joined(q), joined(k)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(len(qo_offsets) - 1):
            ks0, ks1 = kv_offsets[i], kv_offsets[i + 1]
            if ks1 == ks0:
                continue
            ks = k[ks0:ks1].float().transpose(0, 1)
            vs = v[ks0:ks1].float().transpose(0, 1)
            for start, end in _tiles(qo_offsets[i], qo_offsets[i + 1], self.query_tile):
                qs = q[start:end].float().transpose(0, 1)
                o, l = _softmax_attend((qs @ ks.transpose(1, 2)) * scale, vs)
                out[start:end] = o.transpose(0, 1).to(out.dtype)
                lse[start:end] = l.transpose(0, 1)
        return out, lse

    def merge_states(self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                     lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logaddexp(lse_a, lse_b)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        wa = torch.exp(lse_a - safe).unsqueeze(-1)
        wb = torch.exp(lse_b - safe).unsqueeze(-1)
        # A side with no keys (weight 0) is selected away, not multiplied by its zero weight.
        out = (torch.where(wa > 0, wa * out_a.float(), 0.0) + torch.where(wb > 0, wb * out_b.float(), 0.0))
        return out.to(out_a.dtype), lse

    def mla_extend(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        page_size = kv_cache.shape[1]
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        out = q_latent.new_empty(q_latent.shape)
        offsets = batch.qo_offsets
        for i, seq_len in enumerate(batch.seq_lens):
            key_pos = torch.arange(seq_len, device=flat.device)
            slots = batch.page_table[i, key_pos // page_size] * page_size + key_pos % page_size
            # The host length may only bound the device one (a speculative step launched before the
            # step before it was read, model/speculative/future_positions.py): keys past the device
            # length gather the row's first key instead of whatever they hold, as decode's do.
            slots = torch.where(key_pos < batch.seq_lens_t[i], slots, slots[:1])
            kv = flat[slots].float()  # [L, R+P]
            c_kv, k_pe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
            for start, end in _tiles(offsets[i], offsets[i + 1], self.query_tile):
                ql = q_latent[start:end].float().transpose(0, 1)  # [H, t, R]
                qp = q_pe[start:end].float().transpose(0, 1)
                scores = (ql @ c_kv.T + qp @ k_pe.T) * scale  # [H, t, L]
                q_pos = batch.positions[start:end]
                o, _ = _softmax_attend(scores, c_kv, key_pos[None, :] <= q_pos[:, None])
                out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out

    def mla_decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   batch: ForwardBatch, kv_lora_rank: int, scale: float) -> torch.Tensor:
        page_size = kv_cache.shape[1]
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        max_len = max(batch.seq_lens)
        key_pos = torch.arange(max_len, device=flat.device)
        # Rows are padded to the longest page list (with their own pages), so every column index is
        # valid. Columns past a row's length gather its own first token instead of whatever lies
        # there (stale or unchecked memory): every value read is the row's own checked KV, and the
        # columns are then selected away. (Selecting the gathered values instead costs a second
        # pass over [B, L, R+P]: 1.7x the step on CPU.)
        slots = batch.page_table[:, key_pos // page_size] * page_size + key_pos % page_size  # [B, L]
        valid = key_pos[None, :] < batch.seq_lens_t[:, None]  # [B, L]
        kv = flat[torch.where(valid, slots, slots[:, :1])].float()  # [B, L, R+P]
        c_kv, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
        scores = (q_latent.float() @ c_kv.transpose(1, 2) + q_pe.float() @ k_pe.transpose(1, 2)) * scale
        out, _ = _softmax_attend(scores, c_kv, valid[:, None, :])  # [B, H, R]
        return out.to(q_latent.dtype)
