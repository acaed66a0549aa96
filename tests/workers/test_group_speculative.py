"""Speculative decoding in multi-rank groups: `serve decode --dp 2 [--ep 2] --speculative-num-steps 3`
and `--tp 2 --ep 2` (real processes, gloo on loopback, lockstep forwards: data-parallel attention
with experts replicated or spread, attention TP whose follower replays the draft and verify
forwards), colocated, and PD between groups. Their greedy tokens must equal the single-process
offline engine's without speculation, with the MTP layer trained so drafts are accepted (each
engine rank's /metrics). Under EP the ranks' draft (MTP layer) and verify (model) forwards differ
in kind and count: the lockstep tick says which network each step runs (step_sync.ForwardKind)."""
from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.model.checkpoint.tiny import make_tiny_model
from deepseek_pd.ports import pick_free_ports
from pdtest.group_harness import CHUNKED_PREFILL_SIZE, PAGE_SIZE, GroupWorker, generate_all
from deepseek_pd.model.speculative.training import save_mtp_layer, train_mtp

pytestmark = [pytest.mark.slow]


def _spec_counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("deepseek_pd:spec_")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a tiny V3 checkpoint whose MTP layer was trained on `train`'s greedy sequences, the offline
    oracle on it, the training prompts, the seed)."""
    seed = random.randrange(1000)
    rng = random.Random(seed)
    path = make_tiny_model(tmp_path_factory.mktemp("group-spec") / "v3", seed=seed, mtp_layers=1)
    oracle = Engine(str(path), chunked_prefill_size=CHUNKED_PREFILL_SIZE, page_size=PAGE_SIZE)
    train = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    sequences = [p + r.output_ids for p, r in zip(train, oracle.generate_batch(train, greedy))]
    trainer = ModelRunner(RunnerConfig(model=str(path), page_size=PAGE_SIZE, num_pages=256, speculative_num_steps=3))
    train_mtp(trainer, sequences, seconds=10.0)
    save_mtp_layer(trainer, path)
    return path, oracle, train, seed


# (flags, engine ranks: the ranks that schedule and export speculation metrics; a TP follower does neither)
GROUPS = {"dp2": (["--dp", "2"], 2), "dp2-ep2": (["--dp", "2", "--ep", "2"], 2),
          "tp2-ep2": (["--tp", "2", "--ep", "2"], 1)}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("group", list(GROUPS))
def test_group_speculation_equals_the_offline_engine(tmp_path, trained, group) -> None:
    path, oracle, train, seed = trained
    rng = random.Random(seed + 1)
    # the trained prompts (accepting) twice over, so both ranks get some, and fresh ones
    prompts = train * 2 + [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    max_new = [12] * len(train) * 2 + [rng.randint(1, 10) for _ in range(4)]
    want = [r.output_ids for r in oracle.generate_batch(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new])]
    (metrics_port,) = pick_free_ports(1)
    parallel, engines = GROUPS[group]
    with GroupWorker("decode", ["--model", str(path), *parallel, "--speculative-num-steps", "3",
                                "--metrics-port", str(metrics_port)], tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        # ignore_eos on both sides, as the oracle: a greedy EOS (seed 917) must not end one side only
        got = asyncio.run(generate_all(worker.address, prompts, max_new, ignore_eos=True))
        assert got == want, f"seed {seed}\n" + worker.log_tail()
        ranks = [_spec_counters(f"http://127.0.0.1:{metrics_port + r}/metrics") for r in range(engines)]
    for rank, counters in enumerate(ranks):
        rows = counters["deepseek_pd:spec_accept_length_count"]
        print(f"rank {rank}: accept length {counters['deepseek_pd:spec_accept_length_sum'] / rows:.2f}")
        assert counters["deepseek_pd:spec_accepted_tokens_total"] > 0, (seed, rank, counters)


# (prefill group, decode group, whether both overlap two batches)
PD_GROUPS = {
    "dp2-tbo": (["--dp", "2", "--enable-tbo"], ["--dp", "2", "--enable-tbo"], True),
    # the case the first EP attempt hung in: an idle prefill rank against the other's MTP pass
    "dp2-ep2-tbo": (["--dp", "2", "--ep", "2", "--enable-tbo"], ["--dp", "2", "--ep", "2", "--enable-tbo"], True),
    "dp2-ep2-into-tp2-ep2": (["--dp", "2", "--ep", "2"], ["--tp", "2", "--ep", "2"], False),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("groups", list(PD_GROUPS))
def test_pd_between_groups_equals_the_offline_engine(tmp_path, trained, groups) -> None:
    """PD between a prefill group and a decode group (speculation; DP attention with replicated or
    spread experts and two-batch overlap, or into an attention-TP decode group): each prefill rank
    runs the MTP layer over its prompts and sends its KV and first draft to the decode rank the
    room picks; rooms cover both prefill ranks."""
    from deepseek_pd.client.pd_dispatch import PDClient
    from deepseek_pd.client.scheduler_grpc import sampling_proto

    path, oracle, train, seed = trained
    rng = random.Random(seed + 2)
    prompts = train + [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    max_new = [12] * len(train) + [rng.randint(1, 10) for _ in range(4)]
    rooms = [rng.randrange(2**31 - 1) for _ in prompts]
    rooms[0] -= rooms[0] % 2  # both prefill DP ranks get work
    rooms[1] |= 1
    want = [r.output_ids for r in oracle.generate_batch(
        prompts, [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new])]
    (metrics_port,) = pick_free_ports(1)
    prefill_flags, decode_flags, tbo = PD_GROUPS[groups]
    common = ["--model", str(path), "--speculative-num-steps", "3"]
    engines = 1 if "--tp" in decode_flags else 2
    with GroupWorker("prefill", [*common, *prefill_flags], tmp_path / "prefill.log") as prefill, \
            GroupWorker("decode", [*common, *decode_flags, "--metrics-port", str(metrics_port)],
                        tmp_path / "decode.log") as decode:
        async def run() -> list:
            await asyncio.gather(prefill.wait_healthy(), decode.wait_healthy())
            def greedy(n: int):
                params = sampling_proto(max_new_tokens=n, temperature=0.0)
                params.ignore_eos = True  # as the oracle's
                return params

            async with PDClient(prefill.address, "127.0.0.1", prefill.bootstrap_port, decode.address) as client:
                return list(await asyncio.gather(*(
                    client.generate(p, greedy(n), stream=bool(i % 2), room=r)
                    for i, (p, n, r) in enumerate(zip(prompts, max_new, rooms)))))
        results = asyncio.run(run())
        assert all(r.ok for r in results), ([(r.prefill_error, r.decode_error) for r in results],
                                            prefill.log_tail(), decode.log_tail())
        assert [r.output_ids for r in results] == want, (seed, prefill.log_tail(), decode.log_tail())
        ranks = [_spec_counters(f"http://127.0.0.1:{metrics_port + r}/metrics") for r in range(engines)]
        # the overlapped path ran in decode's extends (verify forwards), not only its fallback
        assert not tbo or "two-batch overlap: split a extend batch" in decode.log_path.read_text(), decode.log_tail()
    accepted = sum(c["deepseek_pd:spec_accepted_tokens_total"] for c in ranks)
    rows = sum(c["deepseek_pd:spec_accept_length_count"] for c in ranks)
    emitted = sum(c["deepseek_pd:spec_accept_length_sum"] for c in ranks)
    print(f"PD {groups} accept length {emitted / rows:.2f}")
    assert accepted > 0, (seed, ranks)
