"""EPLB end to end through `serve`: a `--dp 2 --ep 2` group (gloo, the tiny model) with redundant
experts and a random placement file gives the offline engine's greedy tokens; recording on, each
rank serves its expert load at /expert_load; those dumps cover every token the group forwarded,
and `deepseek-pd eplb plan` turns them into a placement the same worker setup accepts. With
speculative decoding the MTP layer's MoE has its own row in the placement and in the dumps, and a
group restarted with the plan (the rebalance) gives the same tokens again.
"""
from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import pytest

from deepseek_pd.cli import main
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.model.eplb.expert_location import moe_layer_ids, resolve_expert_location
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.speculative.mtp_names import mtp_layer_id
from deepseek_pd.ports import pick_free_port_blocks
from deepseek_pd.workers.engine.offline import Engine
from pdtest.eplb_placement import random_placement
from pdtest.group_harness import CHUNKED_PREFILL_SIZE, PAGE_SIZE, GroupWorker, generate_all, offline_greedy
from deepseek_pd.model.speculative.training import save_mtp_layer, train_mtp
from pdtest.rank_metrics import scrape, value
from pdtest.speculative_runner import speculative_greedy

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
    # at EOS before max_new (random prompts do, now and then), so count what was generated. Such a
    # request may also forward one token more: with the overlapped loop, step N+1 is launched before
    # step N is read, so a request that reads EOS in N has a row in N+1 when N+1 was launched in time
    # (its experts did route it). A request that reaches max_new never does (the host knows its end).
    forwarded = sum(len(p) + len(out) - 1 for p, out in zip(prompts, got))
    stopped_early = sum(len(out) < m for out, m in zip(got, max_new))
    k = config.num_experts_per_tok
    assert len(totals) == 1 and forwarded * k <= min(totals) <= (forwarded + stopped_early) * k, (
        totals, forwarded, stopped_early)
    out = tmp_path / "planned.json"
    assert main(["eplb", "plan", "--dump", str(tmp_path / "rank0.json"), "--dump", str(tmp_path / "rank1.json"),
                 "--ep-size", "2", "--redundant", str(redundant), "-o", str(out)]) == 0
    assert resolve_expert_location(config, 2, redundant, str(out)).moe_layer_ids == (1, 2, 3)


@pytest.mark.timeout(480)
def test_speculating_group_with_a_placement_equals_offline_and_rebalances(tmp_path) -> None:
    """Speculation (the MTP layer's MoE over the same EP group, a row of its own in the placement
    and in the load dumps) with redundant experts: `--dp 2 --ep 2 --speculative-num-steps 3` with a
    random placement gives the offline engine's greedy tokens (no speculation, no placement); the
    ranks' dumps add up to the tokens the ranks' forwards ran for requests, by their own accept
    counts (the metrics): each MoE layer saw every prompt token and every verify row's k + 1 tokens,
    the MTP layer every prompt token, each chain's k - 1 and each catch-up's k + 1 (no void row of a
    step launched ahead in either: its request had ended); the plan from them, served by a fresh
    group (the rebalance: a rolling restart with the new file), gives the same tokens again. (Not
    the loads of one process stepping in order: a step launched ahead drafts for the most its last
    step may have emitted, so near a request's budget it may draft fewer, model/speculative/decoder.py.)"""
    rng = random.Random()
    path = make_tiny_model(tmp_path / "v3", seed=rng.randrange(1000), mtp_layers=1)
    config = ModelConfig.from_hf(path)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 24))] for _ in range(rng.randint(4, 6))]
    max_new = [rng.randint(2, 10) for _ in prompts]
    oracle = Engine(str(path), chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new]
    want = [r.output_ids for r in oracle.generate_batch(prompts, greedy)]
    # the MTP layer learns these sequences a little, so drafts are accepted as well as rejected
    steps = 3

    def one(**fields) -> ModelRunner:
        return ModelRunner(RunnerConfig(model=str(path), page_size=PAGE_SIZE, num_pages=512,
                                        speculative_num_steps=steps, **fields))

    trainer = one()
    train_mtp(trainer, [p + w for p, w in zip(prompts, want)], seconds=5.0)
    save_mtp_layer(trainer, path)
    assert speculative_greedy(one(), prompts, max_new, steps)[0] == want
    layers = [*moe_layer_ids(config), mtp_layer_id(config)]
    redundant = 2
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"moe_layer_ids": layers, "physical_to_logical_map": random_placement(
        rng, config.n_routed_experts, redundant, len(layers))}))

    def serve(placement_file, log: str, metrics_port: int) -> tuple[list[dict], list[dict]]:
        args = ["--model", str(path), "--dp", "2", "--ep", "2", "--speculative-num-steps", str(steps),
                "--ep-num-redundant-experts", str(redundant), "--init-expert-location", str(placement_file),
                "--engine-opt=record_expert_load=true", "--metrics-port", str(metrics_port)]
        with GroupWorker("decode", args, tmp_path / log) as worker:
            asyncio.run(worker.wait_healthy())
            got = asyncio.run(generate_all(worker.address, prompts, max_new, ignore_eos=True))
            assert got == want, worker.log_tail()
            dumps = []
            for rank in range(2):
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + rank}/expert_load",
                                            timeout=10) as r:
                    dumps.append(json.loads(r.read()))
            samples = [scrape(metrics_port + rank)[1] for rank in range(2)]
        return dumps, samples

    dumps, samples = serve(placement, "group.log", pick_free_port_blocks([2])[0])
    assert all(d["moe_layer_ids"] == layers for d in dumps), dumps
    totals = [sum(sum(d["logical_counts"][row]) for d in dumps) for row in range(len(layers))]
    drafted = sum(value(s, "spec_draft_tokens_total") for s in samples)
    verify_rows = sum(value(s, "spec_accept_length_count") for s in samples)
    prompt_tokens, topk = sum(len(p) for p in prompts), config.num_experts_per_tok
    assert verify_rows > 0
    assert totals[:-1] == [topk * (prompt_tokens + drafted + verify_rows)] * (len(layers) - 1), (totals, drafted, verify_rows)
    # The MTP layer: a row drafting k >= 1 runs 2k tokens (chain and catch-up), one drafting none 1 (its
    # catch-up); the metrics do not say how many drafted none.
    least = topk * (prompt_tokens + 2 * drafted)
    assert least <= totals[-1] <= least + topk * verify_rows, (totals, drafted, verify_rows)
    for rank, dump in enumerate(dumps):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(dump))
    planned = tmp_path / "planned.json"
    assert main(["eplb", "plan", "--dump", str(tmp_path / "rank0.json"), "--dump", str(tmp_path / "rank1.json"),
                 "--ep-size", "2", "--redundant", str(redundant), "-o", str(planned)]) == 0
    assert resolve_expert_location(config, 2, redundant, str(planned), mtp=True).moe_layer_ids == tuple(layers)
    serve(planned, "rebalanced.log", pick_free_port_blocks([2])[0])
