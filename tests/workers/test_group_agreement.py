"""Every rank of a group must resolve the same dispatcher, DeepEP mode, TBO, CUDA graphs and layout: ranks on
different nodes resolve `serve` on their own (deep_ep may import on one node and not another), and
a difference would pair the wrong collectives. The check runs right after the group forms."""
from __future__ import annotations

import random

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.serve.group_main import agreement_of, check_agreement
from deepseek_pd.workers.serve.resolution import ParallelFlags, ServeFlags, resolve_serve_config

pytestmark = pytest.mark.timeout(120)


def _resolved(**parallel):
    return resolve_serve_config(ServeFlags(role="decode", model="tiny", device="cpu",
                                           parallel=ParallelFlags(**parallel)))


def test_ranks_that_resolved_alike_agree_and_any_difference_is_named() -> None:
    rng = random.Random()
    world = rng.choice([2, 4])
    mine = agreement_of(_resolved(dp=world, ep=world, deepep_mode=rng.choice(["none", "auto", "normal"])))
    check_agreement([dict(mine) for _ in range(world)], 0)
    other = rng.randrange(1, world)
    key = rng.choice(sorted(mine))
    everyone = [dict(mine) for _ in range(world)]
    everyone[other][key] = "something else"
    with pytest.raises(UserError, match=f"rank {other} resolved {key}=.*rank 0 resolved"):
        check_agreement(everyone, rng.randrange(world))


def test_tbo_thresholds_are_engine_options_every_rank_must_share() -> None:
    """The TBO rules decide each step's collective sequence on every rank: a rank given another
    floor is named, and the options resolve into the runner's frozen rules."""
    floor = random.randint(2, 256)
    tuned = resolve_serve_config(ServeFlags(role="decode", model="tiny", device="cpu",
                                            parallel=ParallelFlags(dp=2, ep=2),
                                            engine_options=("enable_tbo=true", f"tbo_min_decode_tokens={floor}",
                                                            "tbo_token_distribution_threshold=0.3")))
    assert tuned.runner.tbo_rules().min_decode_tokens == floor
    assert tuned.runner.tbo_rules().token_distribution_threshold == 0.3
    plain = resolve_serve_config(ServeFlags(role="decode", model="tiny", device="cpu",
                                            parallel=ParallelFlags(dp=2, ep=2), engine_options=("enable_tbo=true",)))
    with pytest.raises(UserError, match="rank 1 resolved tbo_rules="):
        check_agreement([agreement_of(plain), agreement_of(tuned)], 0)


def test_ranks_capturing_other_cuda_graphs_do_not_agree() -> None:
    """CUDA graphs are resolved per node (on only where the device and the backends found there
    can capture), and capturing runs warm-up and capture forwards, EP collectives included, at
    start-up: a rank capturing other batch sizes, or none, would pair its collectives with the
    others' first steps. `cuda_graph` as the other node resolved it stands in for that node."""
    import dataclasses

    mine = _resolved(dp=2, ep=2)
    max_batch = random.randint(1, 256)
    graphs = dataclasses.replace(mine, runner=dataclasses.replace(mine.runner, cuda_graph=True,
                                                                  cuda_graph_max_batch=max_batch))
    other_sizes = dataclasses.replace(graphs, runner=dataclasses.replace(graphs.runner,
                                                                      cuda_graph_max_batch=max_batch + 1))
    check_agreement([agreement_of(graphs), agreement_of(graphs)], 0)
    for theirs in (mine, other_sizes):
        with pytest.raises(UserError, match="rank 1 resolved cuda_graph"):
            check_agreement([agreement_of(graphs), agreement_of(theirs)], 1)


def test_a_node_without_deep_ep_is_told_what_to_do() -> None:
    mine = agreement_of(_resolved(dp=2, ep=2, deepep_mode="normal"))
    theirs = {**mine, "dispatcher": "deepep" if mine["dispatcher"] != "deepep" else "all_to_all"}
    with pytest.raises(UserError, match="deep_ep imports"):
        check_agreement([mine, theirs], 1)


class _JoinedGroup:
    """What `join_group` returns, for `serve_rank`'s start-up: `exchange` answers every rank's
    agreement (`theirs` for the others), `close` is counted."""

    def __init__(self, mine: dict, theirs: dict, world: int) -> None:
        self.answer = [mine] + [theirs] * (world - 1)
        self.is_tp_follower, self.control, self.waker, self.closed = False, None, None, 0

    def exchange(self, _mine):
        return self.answer

    def parallel(self):
        from deepseek_pd.model.distributed.parallel import ParallelInfo
        return ParallelInfo()

    def tp_replay(self):
        return None

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("failure", ["agreement", "runner"])
def test_a_start_up_failure_tears_the_process_groups_down_before_it_propagates(monkeypatch, failure) -> None:
    """Left to interpreter shutdown, a live gloo group at times aborted the process (SIGABRT) instead
    of exiting with the start-up error's status; `serve_rank` closes the group first."""
    import asyncio

    from deepseek_pd.workers.serve import group_main

    config = _resolved(dp=2, ep=2)
    mine = agreement_of(config)
    theirs = {**mine, "page_size": mine["page_size"] + 1} if failure == "agreement" else mine
    group = _JoinedGroup(mine, theirs, 2)
    monkeypatch.setattr(group_main, "join_group", lambda layout, rank, device: group)

    def broken_runner(*args, **kwargs):
        raise RuntimeError("the weights did not load")

    monkeypatch.setattr(group_main, "ModelRunner", broken_runner)
    with pytest.raises(UserError if failure == "agreement" else RuntimeError):
        asyncio.run(group_main.serve_rank(config, 0))
    assert group.closed == 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_pods_with_different_deepep_modes_refuse_to_start(tmp_path) -> None:
    """Two pods of one group, rendered with different --deepep-mode: both stop at start-up with the
    reason, instead of serving with mismatched dispatch layouts."""
    from deepseek_pd.ports import pick_free_ports
    from pdtest.group_harness import GroupWorker

    rng = random.Random()
    modes = rng.sample(["none", "normal", "low_latency", "auto"], 2)
    init_port = pick_free_ports(1)[0]
    pods = [GroupWorker("decode", ["--dp", "2", "--ep", "2", "--nnodes", "2", "--node-rank", str(i),
                                   "--dist-init-addr", f"127.0.0.1:{init_port}", "--deepep-mode", modes[i]],
                        tmp_path / f"pod{i}.log") for i in range(2)]
    with pods[0] as leader, pods[1] as follower:
        for pod in (leader, follower):
            assert pod.proc.wait(120) == 2, pod.log_tail()
            text = pod.log_path.read_text()
            assert "resolved deepep_mode=" in text and "every rank of a group must agree" in text, pod.log_tail()
