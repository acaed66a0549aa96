"""An in-process stand-in for the `deep_ep` module (DeepEP V1's `Buffer`) at world size 1, so the
`deepep` dispatcher runs on the CPU test machine.

Plain-torch, loop-per-token implementations of the V1 calls the dispatcher makes (FACTS.md's
interface summary), written from DeepEP's documented semantics rather than from the dispatcher:

- normal: `get_dispatch_layout`, `dispatch` (a token goes to the rank if any of its ids is >= 0;
  ids and weights travel with it), `combine` (sums each token's received rows: one at world 1);
- low-latency: `low_latency_dispatch` packs each expert's tokens into `[E, C * ranks, H]` with a
  count per expert, `low_latency_combine` applies the top-k weights; with `return_recv_hook` the
  receive happens only when the hook is called (until then the outputs stay zero);
- `clean_low_latency_buffer`: DeepEP requires it after normal kernels ran and before the next
  low-latency kernel; this fake raises if a low-latency kernel finds the buffer dirty.
"""
from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    def current_stream_wait(self) -> None:
        pass


class _SizeHints:
    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class Buffer:
    created: list["Buffer"] = []

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 1) -> None:
        self.group = group
        self.low_latency_mode = low_latency_mode
        self.num_rdma_bytes = num_rdma_bytes
        self.dirty = False  # normal kernels ran since the low-latency part was last cleaned
        self.cleans: list[tuple[int, int, int]] = []
        self.calls: list[str] = []
        Buffer.created.append(self)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _SizeHints:
        return _SizeHints()

    @staticmethod
    def get_combine_config(num_ranks: int) -> _SizeHints:
        return _SizeHints()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return 2 * num_max_dispatch_tokens_per_rank * hidden * num_experts * 2

    # ---- normal ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        self.calls.append("get_dispatch_layout")
        valid = topk_idx >= 0
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts)
        in_rank = valid.any(dim=1, keepdim=True)  # [T, 1]: one rank
        return in_rank.sum(dim=0), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, async_finish=False, **_: Any):
        self.calls.append("dispatch")
        self.dirty = True
        rows = is_token_in_rank[:, 0].nonzero().flatten()
        handle = (rows, x.shape[0])
        return (x[rows], topk_idx[rows], topk_weights[rows], num_tokens_per_expert.tolist(), handle, EventOverlap())

    def combine(self, x, handle, topk_weights=None, async_finish=False, **_: Any):
        self.calls.append("combine")
        self.dirty = True
        rows, num_tokens = handle
        out = x.new_zeros(num_tokens, x.shape[-1])
        out.index_add_(0, rows, x)
        return out, None, EventOverlap()

    # ---- low-latency ----------------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.calls.append("clean_low_latency_buffer")
        self.cleans.append((num_max_dispatch_tokens_per_rank, hidden, num_experts))
        self.dirty = False

    def _check_clean(self) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency kernel on a Buffer built with low_latency_mode=False")
        if self.dirty:
            raise RuntimeError("low-latency kernel after normal kernels without clean_low_latency_buffer")

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False, **_: Any):
        self.calls.append("low_latency_dispatch")
        self._check_clean()
        capacity = num_max_dispatch_tokens_per_rank
        assert x.shape[0] <= capacity, "DeepEP asserts num_tokens <= num_max_dispatch_tokens_per_rank"
        recv_x = x.new_zeros(num_experts, capacity, x.shape[-1])
        recv_count = torch.zeros(num_experts, dtype=torch.int32)
        slots: dict[tuple[int, int], int] = {}

        def receive() -> None:
            for token in range(x.shape[0]):
                for expert in topk_idx[token].tolist():
                    if expert >= 0:
                        slot = int(recv_count[expert])
                        recv_x[expert, slot] = x[token]
                        slots[(token, expert)] = slot
                        recv_count[expert] += 1

        if not return_recv_hook:
            receive()
        return recv_x, recv_count, (slots, x.shape[0]), EventOverlap(), receive if return_recv_hook else None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False,
                            **_: Any):
        self.calls.append("low_latency_combine")
        self._check_clean()
        slots, num_tokens = handle
        out = torch.zeros(num_tokens, x.shape[-1], dtype=x.dtype)

        def receive() -> None:
            for token in range(num_tokens):
                for expert, weight in zip(topk_idx[token].tolist(), topk_weights[token].tolist()):
                    if expert >= 0:
                        out[token] += weight * x[expert, slots[(token, expert)]]

        if not return_recv_hook:
            receive()
        return out, EventOverlap(), receive if return_recv_hook else None
