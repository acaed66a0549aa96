"""Redundant experts and a static placement over gloo on CPU (world sizes 2 and 4).

The placement is a fresh random permutation of the experts plus R random replicas per MoE layer;
every rank runs its own tokens (uneven counts, one idle step) through the EP runner built from the
placement file (world 4 also with fused shared experts and two-batch overlap) and through the
single-process model, and the logits must agree in fp32. The
expert-load recorder must count the router's own top-k choices in logical ids (once per token
choice, whatever the replicas), per rank and summed over the group, and every slot must hold a
copy of its logical expert's weights.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from pdtest.eplb_worker import run_rank
from pdtest.eplb_placement import random_placement

REL_TOL = 1e-5


@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("world, redundant, fused, tbo", [(2, 2, 0, False), (4, 4, 1, True)],
                         ids=["ep2-r2", "ep4-r4-fused-shared-tbo"])
def test_redundant_experts_equal_single_process(tmp_path, world, redundant, fused, tbo):
    seed = random.randrange(1 << 20)
    rng = random.Random(seed)
    checkpoint = make_tiny_model(tmp_path / "checkpoint", seed=seed)
    config = json.loads((checkpoint / "config.json").read_text())
    moe_layers = [i for i in range(config["num_hidden_layers"]) if i >= config["first_k_dense_replace"]]
    rows = random_placement(rng, config["n_routed_experts"], redundant, len(moe_layers))
    (tmp_path / "placement.json").write_text(json.dumps({"physical_to_logical_map": rows}))
    torch.multiprocessing.spawn(run_rank, args=(world, pick_free_ports(1)[0], str(tmp_path), seed, redundant, fused, tbo),
                                nprocs=world, join=True)
    num_logical = config["n_routed_experts"]
    per_rank_counts = []
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["slots"] and all(results["slots"].values()), f"rank {rank}: slot weights {results['slots']}"
        for case, want in results["reference"].items():
            got = results["ep"][case]
            assert got.shape == want.shape, (rank, case)
            if want.numel():
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= REL_TOL, f"seed {seed} rank {rank} {case}: rel err {err:.2e}"
        counts = results["counts"]
        for row, layer_id in enumerate(results["moe_layer_ids"]):
            chosen = results["chosen"][layer_id]
            assert int(chosen.max()) < num_logical  # the router's ids are logical, never slots
            assert torch.equal(counts[row], torch.bincount(chosen, minlength=num_logical)), (rank, layer_id)
        per_rank_counts.append(counts)
        group_counts = torch.tensor(results["group_counts"])
    assert torch.equal(group_counts, sum(per_rank_counts))  # the group dump is the sum over ranks
