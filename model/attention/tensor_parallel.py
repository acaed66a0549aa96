"""Attention tensor parallelism for MLA: which heads a TP rank holds, and its two collectives.

With `ParallelInfo.tp_size = T > 1` the T ranks of one TP group run the same tokens (their DP
group's batch). Each holds H / T of the attention heads:
    q_b_proj (q_proj without q-LoRA)  column-parallel: the rows of its heads (and their FP8 scales)
    w_kc, w_vc (kv_b_proj)            the slices of its heads
    o_proj                            row-parallel: the input columns of its heads, then the partial
                                      outputs are summed over the TP group (`all_reduce`)
    q_a / kv_a projections, norms     replicated (every rank computes the same latent)
    latent KV cache                   replicated: `[c_kv | k_pe]` is shared by all heads, so every
                                      TP rank writes the same values into its own pool
Example: V3 (128 heads) at tp 8: rank 3 holds heads 48..63, q_b_proj rows 48*192..64*192.

The MoE input under TP: every TP rank holds the same tokens, and routed experts are spread over all
ranks (EP), so dispatching all of them from each TP rank would count each token T times. Instead
(SGLang's `LayerCommunicator` "scattered" mode) each TP rank dispatches a 1/T slice of the rows
(`TokenScatter.scatter`: rank r takes rows [r*c, (r+1)*c), c = ceil(n / T), possibly none) and the
MoE outputs are all-gathered back to every row (`TokenScatter.gather`). Shared experts run on the
slice too. Without EP (experts replicated) or at tp 1 nothing is scattered (`NO_SCATTER`).
"""
from __future__ import annotations

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.parallel import ParallelInfo


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


class NoScatter:
    """Every rank dispatches all of its rows (DP attention, or experts replicated)."""

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, y: torch.Tensor, total: int) -> torch.Tensor:
        return y


NO_SCATTER = NoScatter()


class TokenScatter:
    """The MoE input of a TP group split by rows over its ranks, and gathered back after."""

    def __init__(self, parallel: ParallelInfo) -> None:
        self.parallel = parallel

    def _chunk(self, total: int) -> int:
        return -(-total // self.parallel.tp_size)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        chunk = self._chunk(x.shape[0])
        start = min(x.shape[0], self.parallel.tp_rank * chunk)
        return x[start:min(x.shape[0], start + chunk)]

    def gather(self, y: torch.Tensor, total: int) -> torch.Tensor:
        """This rank's output rows `y` (its `scatter` slice) → all `total` rows, on every TP rank."""
        chunk = self._chunk(total)
        if chunk == 0:  # no rows on any rank of the group (it is idle): nothing to exchange
            return y
        import torch.distributed as dist

        padded = y.new_zeros(chunk, *y.shape[1:])
        padded[:y.shape[0]] = y
        parts = [torch.empty_like(padded) for _ in range(self.parallel.tp_size)]
        dist.all_gather(parts, padded, group=self.parallel.tp_group)
        return torch.cat(parts)[:total]


def token_scatter(parallel: ParallelInfo) -> NoScatter | TokenScatter:
    """Chosen at build time: scatter only where TP ranks share tokens and experts are spread (EP)."""
    return TokenScatter(parallel) if parallel.tp_size > 1 and parallel.ep_size > 1 else NO_SCATTER
