"""Attention tensor parallelism over gloo on CPU: TP 2, TP 2 with EP 2, and TP 2 x DP 2 with EP 4
give the world-size-1 logits (fp32) for MHA and chunked-KV prefill, absorbed-MLA extend and decode,
row counts that tp does not divide and an idle DP group. One `torch.multiprocessing.spawn` of 4
ranks runs every case (`tp_worker.run_rank`); each rank compares against the reference of its own
DP group's tokens. Dense layers are data-parallel over the TP ranks (model/distributed/scatter_mode.py): each
TP rank's dense MLP runs on its share of the rows only, which the rows counted per forward show.
"""
from __future__ import annotations

import random

import pytest
import torch

from deepseek_pd.ports import pick_free_ports

from pdtest.hf_oracle import TinyShape, build_hf_model
from pdtest.tp_worker import TP, VARIANTS, run_rank

REL_TOL = 1e-5
WORLD = 4


def _share(rows: int, tp_rank: int) -> int:
    """How many of `rows` TP rank `tp_rank` holds when they are scattered over the TP ranks (written
    out again here, as the test's own statement of `row_share` in attention/tensor_parallel.py)."""
    chunk = -(-rows // TP)
    return max(0, min(chunk, rows - tp_rank * chunk))


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("shape", [
    TinyShape(arch="v3", num_layers=3),  # q-LoRA: q_b_proj is column-split
    # q_proj split; two dense layers in a row (scattered rows from one dense MLP to the next)
    TinyShape(arch="v2", q_lora_rank=None, topk_method="group_limited_greedy", num_layers=3, first_k_dense_replace=2),
], ids=["v3", "v2-no-q-lora"])
def test_tp_attention_equals_world_size_one(tmp_path, shape):
    seed = random.randrange(1 << 20)
    # 4 heads (2 per TP rank), dense layers then MoE layers.
    hf = build_hf_model(shape, seed=seed)
    torch.save({"config": hf.config.to_dict(), "state": dict(hf.state_dict())}, tmp_path / "model.pt")
    hf.save_pretrained(tmp_path / "checkpoint")
    torch.multiprocessing.spawn(run_rank, args=(WORLD, pick_free_ports(1)[0], str(tmp_path), seed), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        heads = results.pop("local_heads")
        assert heads["reference"] == 4 and all(heads[v] == 2 for v in VARIANTS), heads
        dense_rows = results.pop("dense_rows")
        want_rows = [_share(rows, rank % TP) for rows in dense_rows["reference"]]
        assert any(rows % TP for rows in dense_rows["reference"]), dense_rows  # shares of unequal size
        for variant in VARIANTS:
            assert dense_rows[variant] == want_rows, (rank, variant, dense_rows)
        reference = results.pop("reference")
        for variant in VARIANTS:
            for case, want in reference.items():
                got = results[variant][case]
                assert got.shape == want.shape, (rank, variant, case)
                if not want.numel():
                    continue  # this rank's DP group was idle in this step
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= REL_TOL, f"seed {seed} rank {rank} {variant} {case}: rel err {err:.2e}"
