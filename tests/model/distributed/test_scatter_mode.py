"""`LayerScatterModes` per layer for each layout (model/distributed/scatter_mode.py), the row-share rule, and
the TP collectives over rows (`all_gather_rows`, `reduce_scatter_rows`) against plain torch over
gloo at tp 3 with row counts tp does not divide, none, or fewer than tp."""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.model.attention.tensor_parallel import all_gather_rows, own_rows, reduce_scatter_rows, row_share
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.scatter_mode import LayerScatterModes, ScatterMode
from pdtest.hf_oracle import TinyShape

F, S = ScatterMode.TP_ATTN_FULL, ScatterMode.SCATTERED
# Two dense layers, then two MoE layers.
CONFIG = ModelConfig.from_hf(TinyShape(num_layers=4, first_k_dense_replace=2).hf_config().to_dict())


@pytest.mark.parametrize("tp, ep, want", [
    (1, 1, [(F, F, F, F)] * 4),
    (1, 4, [(F, F, F, F)] * 4),  # a TP group of one rank: the modes coincide, nothing moves
    # dense and EP MoE scattered; the last layer hands full rows to the final norm
    (2, 4, [(F, F, S, S), (S, F, S, S), (S, F, S, S), (S, F, S, F)]),
    # experts replicated: every TP rank runs all rows through MoE, dense stays scattered; the first
    # MoE layer gathers the residual it gets scattered
    (2, 1, [(F, F, S, S), (S, F, S, S), (S, F, F, F), (F, F, F, F)]),
], ids=["tp1", "tp1-ep4", "tp2-ep4", "tp2-ep1"])
def test_layer_modes(tp, ep, want):
    parallel = ParallelInfo(ep_size=ep, tp_size=tp, tp_rank=tp - 1)
    modes = [LayerScatterModes.for_layer(CONFIG, i, parallel) for i in range(CONFIG.num_hidden_layers)]
    assert [(m.layer_input, m.attn, m.mlp, m.layer_output) for m in modes] == want
    for before, after in zip(modes, modes[1:]):
        assert after.layer_input is before.layer_output


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_row_shares_split_the_rows_in_order(tp):
    for total in range(10):
        shares = [row_share(total, ParallelInfo(tp_size=tp, tp_rank=t)) for t in range(tp)]
        assert [i for s in shares for i in range(total)[s]] == list(range(total))
        assert max(s.stop - s.start for s in shares) == -(-total // tp)


TP = 3
ROWS = (0, 1, 2, 3, 5, 7)  # none, fewer than tp, not divisible by tp, divisible


def _rows_rank(rank: int, port: int, seed: int) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        parallel = ParallelInfo(tp_size=TP, tp_rank=rank, tp_group=None)
        for total in ROWS:
            gen = torch.Generator().manual_seed(seed * 100 + total)  # every rank draws every rank's tensors
            partials = torch.randn(TP, total, 4, generator=gen)
            full = partials[0]
            assert torch.equal(all_gather_rows(own_rows(full, parallel), total, parallel), full), total
            got = reduce_scatter_rows(partials[rank], parallel)
            torch.testing.assert_close(got, own_rows(partials.sum(0), parallel), rtol=1e-6, atol=1e-6)
            assert got.shape[0] == len(range(total)[row_share(total, parallel)]), total
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_row_collectives_equal_torch_over_gloo():
    torch.multiprocessing.spawn(_rows_rank, args=(pick_free_ports(1)[0], random.randrange(1 << 20)), nprocs=TP, join=True)
