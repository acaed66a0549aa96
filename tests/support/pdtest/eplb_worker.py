"""The body of one gloo rank in `test_eplb_ep.py` (its own module so spawned children import only
torch and deepseek_pd).

Each rank builds, from the same checkpoint directory, the single-process reference (ep_size 1, no
placement) and the EP runner with redundant experts and the parent's placement file, the way a
worker builds it (`RunnerConfig(ep_num_redundant_experts=R, init_expert_location=FILE)`, with
fused shared experts and two-batch overlap where the test asks for them), and
drives both through `ep_worker._scenario` (extend, extend with a prefix, decode, an uneven step,
an idle rank). The EP runner records its expert load while a spy keeps the router's own top-k
choices. Written to `<dir>/rank<r>.pt`: both runs' logits, the recorder's counts and group dump,
the spied choices, and whether every local slot holds a copy of its logical expert's weights.
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

import torch

from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from pdtest.ep_worker import _scenario

GLOO_TIMEOUT = datetime.timedelta(seconds=60)


def spy_topk(runner: ModelRunner) -> dict[int, list[torch.Tensor]]:
    """Wraps each MoE layer's top-k method; returns layer id -> the logical ids it chose, per call."""
    seen: dict[int, list[torch.Tensor]] = {}
    for layer in runner.model.layers:
        if not layer.is_moe:
            continue

        def spied(scores, bias, spec, _choose=layer.mlp.choose, _id=layer.layer_id):
            weights, ids = _choose(scores, bias, spec)
            seen.setdefault(_id, []).append(ids.clone())
            return weights, ids
        layer.mlp.choose = spied
    return seen


def slots_hold_their_experts(reference: ModelRunner, ep: ModelRunner) -> dict[str, bool]:
    """Per MoE layer: is each of this rank's slots an exact copy of the logical expert it holds?"""
    report = {}
    for full, part in zip(reference.model.layers, ep.model.layers):
        if not full.is_moe:
            continue
        logical = torch.tensor(part.mlp.placement.local_logical(full.layer_id))
        n = len(logical)
        report[f"layer{full.layer_id}"] = (torch.equal(part.mlp.experts.w13[:n], full.mlp.experts.w13[logical])
                                           and torch.equal(part.mlp.experts.w2[:n], full.mlp.experts.w2[logical]))
    return report


def run_rank(rank: int, world: int, port: int, directory: str, seed: int, redundant: int, fused: int,
             tbo: bool) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    try:
        root = Path(directory)
        base = RunnerConfig(model=str(root / "checkpoint"), page_size=4, num_pages=128, mha_chunked_kv_threshold=1,
                            prefix_chunk_size=3, num_fused_shared_experts=fused)
        group = ParallelInfo.from_group()
        reference = ModelRunner(base)
        ep = ModelRunner(dataclasses.replace(base, ep_size=world, ep_num_redundant_experts=redundant, enable_tbo=tbo,
                                             init_expert_location=str(root / "placement.json")), parallel=group)
        recorder = ep.record_expert_load()
        seen = spy_topk(ep)
        vocab = reference.model_config.vocab_size
        results: dict[str, Any] = {"reference": _scenario(reference, rank, world, seed, vocab),
                                   "ep": _scenario(ep, rank, world, seed, vocab)}
        results["counts"] = recorder.snapshot()
        results["group_counts"] = recorder.dump(group).logical_counts
        results["chosen"] = {layer: torch.cat(ids).reshape(-1) for layer, ids in seen.items()}
        results["moe_layer_ids"] = recorder.moe_layer_ids
        results["slots"] = slots_hold_their_experts(reference, ep)
        torch.save(results, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
