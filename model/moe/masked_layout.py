"""The low-latency (masked) layout, flattened for the experts: shared by both EP dispatchers'
low-latency halves (`a2a_low_latency.py`, `deepep_dispatcher.py`), which receive the same shape.

The masked layout is `recv_x [L, M, H]` (local expert l's rows first, M rows each) and
`recv_count [L]` (how many of them are real). The experts see it as `L*M` rows with one local
expert id each (`-1` past the count: a padding row no expert computes) and weight 1, since the
low-latency combine applies the top-k weights itself.

Example: L=2, M=3, recv_count=[1, 2] → ids [0, -1, -1, 1, 1, -1] (as a column), weights all 1.
"""
from __future__ import annotations

import torch

from deepseek_pd.model.moe.dispatcher import DispatchOutput


def flatten_masked(recv_x: torch.Tensor, recv_count: torch.Tensor, handle: object) -> DispatchOutput:
    """`recv_x [L, M, H]` and `recv_count [L]` as the experts' rows (module docstring); device-only,
    so capturable in a CUDA graph. `handle` is what the dispatcher's combine needs."""
    num_local, max_rows, width = recv_x.shape
    rows = torch.arange(max_rows, device=recv_x.device)
    experts = torch.arange(num_local, device=recv_x.device).unsqueeze(-1)
    ids = torch.where(rows < recv_count.unsqueeze(-1), experts, -1).reshape(-1, 1)
    weights = torch.ones(ids.shape, dtype=torch.float32, device=recv_x.device)
    return DispatchOutput(recv_x.reshape(-1, width), ids, weights, handle)
