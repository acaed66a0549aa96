"""Attention tensor parallelism for MLA: which heads a TP rank holds, and the TP group's collectives.

With `ParallelInfo.tp_size = T > 1` the T ranks of one TP group run the same tokens (their DP
group's batch). Each holds H / T of the attention heads:
    q_b_proj (q_proj without q-LoRA)  column-parallel: the rows of its heads (and their FP8 scales)
    w_kc, w_vc (kv_b_proj)            the slices of its heads
    o_proj                            row-parallel: the input columns of its heads; its output is a
                                      partial sum, reduced over the TP group by the layer's
                                      communicator (`all_reduce`, or `reduce_scatter_rows` when the
                                      MLP runs on scattered rows; model/distributed/layer_communicator.py)
    q_a / kv_a projections, norms     replicated (every rank computes the same latent)
    latent KV cache                   replicated: `[c_kv | k_pe]` is shared by all heads, so every
                                      TP rank writes the same values into its own pool
Example: V3 (128 heads) at tp 8: rank 3 holds heads 48..63, q_b_proj rows 48*192..64*192.

Rows of a TP group (what `ScatterMode.SCATTERED` means, model/distributed/scatter_mode.py): of the group's n
rows, TP rank t holds rows [t*c, min(n, (t+1)*c)), c = ceil(n / T) (`row_share`; the last ranks
may hold fewer or none). `all_gather_rows` and `reduce_scatter_rows` pad every share to c rows
so the collectives see equal sizes (NCCL and gloo both need them), and drop the padding after.
Example: n = 5, T = 2: c = 3, rank 0 holds rows 0..2, rank 1 rows 3, 4 (padded with one zero row).
"""
from __future__ import annotations

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.distributed.parallel import ParallelInfo


def local_heads(num_heads: int, parallel: ParallelInfo) -> range:
    """The global head ids this TP rank holds (all of them at tp 1)."""
    tp = parallel.tp_size
    if num_heads % tp:
        raise UserError(f"attention TP {tp} does not divide num_attention_heads {num_heads}: "
                        f"every TP rank must hold the same number of heads")
    per_rank = num_heads // tp
    return range(parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank)


def all_reduce(x: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """Sums `x` over the TP group (o_proj's partial outputs); `x` itself at tp 1."""
    if parallel.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x, group=parallel.tp_group)
    return x


def _chunk(total: int, parallel: ParallelInfo) -> int:
    return -(-total // parallel.tp_size)


def row_share(total: int, parallel: ParallelInfo) -> slice:
    """The rows, of a TP group's `total`, this TP rank holds when they are scattered (the one rule)."""
    chunk = _chunk(total, parallel)
    start = min(total, parallel.tp_rank * chunk)
    return slice(start, min(total, start + chunk))


def own_rows(x: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """All of the group's rows → this rank's share (a view; no communication)."""
    return x[row_share(x.shape[0], parallel)]


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros(rows, *x.shape[1:])
    out[:x.shape[0]] = x
    return out


def all_gather_rows(x: torch.Tensor, total: int, parallel: ParallelInfo) -> torch.Tensor:
    """This rank's share `x` (its `row_share` of `total`) → all `total` rows, on every TP rank."""
    chunk = _chunk(total, parallel)
    if parallel.tp_size == 1 or chunk == 0:  # one rank, or the whole group is idle: nothing to exchange
        return x
    import torch.distributed as dist

    out = x.new_empty(chunk * parallel.tp_size, *x.shape[1:])
    dist.all_gather_single(out, _padded(x, chunk), group=parallel.tp_group)
    return out[:total]


def reduce_scatter_rows(x: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """Every rank's partial sums of all rows `x` → this rank's share of the sum (half the traffic
    of `all_reduce` followed by `own_rows`)."""
    total = x.shape[0]
    chunk = _chunk(total, parallel)
    if parallel.tp_size == 1 or chunk == 0:
        return x
    import torch.distributed as dist

    out = x.new_empty(chunk, *x.shape[1:])
    dist.reduce_scatter_single(out, _padded(x, chunk * parallel.tp_size), group=parallel.tp_group)
    share = row_share(total, parallel)
    return out[:share.stop - share.start]
