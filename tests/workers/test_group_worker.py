"""A worker that is a group of ranks: `serve --dp N --ep N` on CPU (gloo, tiny model), end to end.

The oracle is the single-process offline engine: the group's greedy tokens, through rank 0's real
SglangScheduler servicer, must equal it for a batch of fresh random prompts (several chunks long,
streaming and unary), with DP attention (requests spread over the ranks, each rank's KV its own)
and the routed experts spread over every rank (the all_to_all dispatcher).
"""
from __future__ import annotations

import asyncio
import random

import pytest

from pdtest.group_harness import GroupWorker, generate_all, offline_greedy

pytestmark = [pytest.mark.slow]

VOCAB = 256  # the tiny model's vocabulary is larger; stay in its byte range


def _prompts(rng: random.Random, count: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    return prompts, [rng.randint(1, 8) for _ in range(count)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["--dp", "2", "--ep", "2"], ["--tp", "2", "--dp", "2", "--ep", "4"]],
                         ids=["dp2-ep2", "tp2-dp2-ep4"])
def test_group_equals_offline_engine(tmp_path, layout) -> None:
    rng = random.Random()
    prompts, max_new = _prompts(rng, rng.randint(5, 7))
    want = offline_greedy(prompts, max_new)
    with GroupWorker("decode", layout, tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        got = asyncio.run(generate_all(worker.address, prompts, max_new))
        assert got == want, worker.log_tail()


@pytest.mark.timeout(200)
def test_idle_ranks_and_a_killed_rank_ends_the_group(tmp_path) -> None:
    """One request on a 4-rank group (three ranks idle, joining every all-to-all with zero
    tokens) still equals the oracle; then SIGKILL of one follower rank ends the whole group with a
    non-zero status within a bound, never a hang."""
    import os
    import signal
    import subprocess
    import time

    rng = random.Random()
    prompts, max_new = _prompts(rng, 1)
    want = offline_greedy(prompts, max_new)
    with GroupWorker("decode", ["--dp", "4", "--ep", "4"], tmp_path / "group.log") as worker:
        asyncio.run(worker.wait_healthy())
        assert asyncio.run(generate_all(worker.address, prompts, max_new)) == want, worker.log_tail()
        children = subprocess.run(["pgrep", "-P", str(worker.proc.pid)], capture_output=True, text=True)
        ranks = [int(pid) for pid in children.stdout.split()]
        assert len(ranks) >= 4, children.stdout
        victim = rng.choice(ranks[1:])
        started = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        status = worker.proc.wait(60)
        assert status != 0 and time.monotonic() - started < 60
        assert "stopping the other ranks" in worker.log_path.read_text(), worker.log_tail()


@pytest.mark.timeout(240)
def test_pd_into_dp_decode_ranks_equals_offline_engine(tmp_path) -> None:
    """A single prefill worker and a decode group (dp 2, ep 2): each request's KV lands on the
    decode DP rank of its room (`room % 2`), whose own bootstrap client pulls it rank to rank."""
    from deepseek_pd.client.pd_dispatch import PDClient
    from deepseek_pd.client.scheduler_grpc import sampling_proto

    rng = random.Random()
    prompts, max_new = _prompts(rng, 6)
    want = offline_greedy(prompts, max_new)
    with GroupWorker("prefill", [], tmp_path / "prefill.log") as prefill, \
            GroupWorker("decode", ["--dp", "2", "--ep", "2"], tmp_path / "decode.log") as decode:
        async def run() -> list:
            await prefill.wait_healthy()
            await decode.wait_healthy()
            async with PDClient(prefill.address, "127.0.0.1", prefill.bootstrap_port, decode.address) as client:
                return await asyncio.gather(*(client.generate(p, sampling_proto(max_new_tokens=n, temperature=0.0),
                                                              stream=True) for p, n in zip(prompts, max_new)))
        results = asyncio.run(run())
        assert all(r.ok for r in results), [(r.prefill_error, r.decode_error) for r in results]
        assert [r.output_ids for r in results] == want, decode.log_tail()


def _group_flags(argv: list[str]) -> list[str]:
    """The flags of `argv` that shape a group (launcher.worker_plan.GROUP_FLAGS), with their values."""
    from deepseek_pd.launcher.worker_plan import GROUP_FLAGS

    out = []
    for i, arg in enumerate(argv):
        if arg in GROUP_FLAGS:
            takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            out += argv[i:i + 1 + takes_value]
    return out


@pytest.mark.timeout(200)
def test_two_pod_group_as_the_operator_renders_it(tmp_path) -> None:
    """`cpu-minimal.yaml` with `size: 2` (pdtest.rendered_pods: DP+EP or TP, drawn per run): each
    decode pod's group flags (`--dp 2 --ep 2` or `--tp 2`, `--nnodes 2 --node-rank I --dist-init-addr
    LEADER:PORT`) come from the operator's rendered pod, expanded as the kubelet does, the leader's
    name mapped to 127.0.0.1 (pdtest.local_pods). Two separate `serve` processes (one rank each)
    form one group and serve. (tests/operator/test_rendered_pods_run.py runs the whole rendered
    argv behind the rendered router.)"""
    from deepseek_pd.operator import names

    from pdtest.local_pods import localize, tiny_model_host_paths
    from pdtest.rendered_pods import RenderedDeployment, cpu_minimal_spec

    rng = random.Random()
    spec = cpu_minimal_spec(rng, pods_per_group=2)
    pods = sorted((p for p in localize(RenderedDeployment(spec), tmp_path / "pods", tiny_model_host_paths(spec, tmp_path))
                   if p.pod["metadata"]["labels"].get(names.LABEL_ROLE) == "decode"),
                  key=lambda p: int(p.pod["metadata"]["labels"][names.LABEL_POD_INDEX]))
    flags = [_group_flags(pod.main[0].argv) for pod in pods]
    assert [f[f.index("--node-rank") + 1] for f in flags] == ["0", "1"], flags
    prompts, max_new = _prompts(rng, 3)
    want = offline_greedy(prompts, max_new)
    workers = [GroupWorker("decode", f, tmp_path / f"pod{i}.log") for i, f in enumerate(flags)]
    with workers[0] as leader, workers[1]:
        asyncio.run(leader.wait_healthy())
        assert asyncio.run(generate_all(leader.address, prompts, max_new)) == want, leader.log_tail()
