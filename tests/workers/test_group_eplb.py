"""EPLB end to end through `serve`: a `--dp 2 --ep 2` group (gloo, the tiny model) with redundant
experts and a random placement file gives the offline engine's greedy tokens; recording on, each
rank serves its expert load at /expert_load; those dumps cover every token the group forwarded,
and `deepseek-pd eplb plan` turns them into a placement the same worker setup accepts.
"""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import pytest

from deepseek_pd.cli import main
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.eplb.expert_location import resolve_expert_location
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from deepseek_pd.ports import pick_free_port_blocks
from pdtest.group_harness import GroupWorker, generate_all, offline_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
VOCAB = 256  # stay in the tiny tokenizer's byte range


def test_group_with_redundant_experts_equals_offline_and_dumps_its_load(tmp_path) -> None:
    rng = random.Random()
    config = ModelConfig.from_hf(resolve_model_dir("tiny"))
    n, redundant = config.n_routed_experts, 2
    rows = []
    for _ in (1, 2, 3):  # the tiny model's MoE layers
        row = list(range(n)) + [rng.randrange(n) for _ in range(redundant)]
        rng.shuffle(row)
        rows.append(row)
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"physical_to_logical_map": rows}))
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 30))] for _ in range(rng.randint(4, 6))]
    max_new = [rng.randint(1, 6) for _ in prompts]
    want = offline_greedy(prompts, max_new)
    metrics_port = pick_free_port_blocks([2])[0]
    args = ["--dp", "2", "--ep", "2", "--ep-num-redundant-experts", str(redundant),
            "--init-expert-location", str(placement), "--engine-opt=record_expert_load=true",
            "--metrics-port", str(metrics_port)]
    with GroupWorker("decode", args, tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        got = asyncio.run(generate_all(worker.address, prompts, max_new))
        assert got == want, worker.log_tail()
        dumps = []
        for rank in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + rank}/expert_load", timeout=10) as r:
                dumps.append(json.loads(r.read()))
    for rank, dump in enumerate(dumps):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(dump))
    totals = {sum(sum(d["logical_counts"][row]) for d in dumps) for row in range(3)}
    # Each request forwards its prompt and every output token but the last; a greedy request may stop
    # at EOS before max_new (random prompts do, now and then), so count what was generated.
    forwarded = sum(len(p) + len(out) - 1 for p, out in zip(prompts, got))
    assert totals == {forwarded * config.num_experts_per_tok}, (totals, forwarded)
    out = tmp_path / "planned.json"
    assert main(["eplb", "plan", "--dump", str(tmp_path / "rank0.json"), "--dump", str(tmp_path / "rank1.json"),
                 "--ep-size", "2", "--redundant", str(redundant), "-o", str(out)]) == 0
    assert resolve_expert_location(config, 2, redundant, str(out)).moe_layer_ids == (1, 2, 3)
