"""`up`'s plan for multi-rank workers, without starting a worker: the flags `up` accepts and refuses,
the ports of every rank of every group (distinct, free, consecutive metrics runs), and the `serve`
command of each worker read back by `serve`'s own parser and group layout (the oracle: what a
group of that command would really run).

The supervisor's gang rule runs on real processes (a leader with a child in its process group).
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.commands.up import cluster_spec_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.ports import is_port_free, pick_free_port_blocks
from deepseek_pd.launcher.process import ManagedProcess
from deepseek_pd.launcher.supervisor import Supervisor, SupervisorConfig
from deepseek_pd.launcher.worker_plan import GroupShape, ServeSettings, plan_workers, port_block_sizes, serve_argv
from deepseek_pd.workers.group.layout import GroupLayout
from deepseek_pd.workers.metrics.server import MetricsConfig
from pdtest.process_tree import alive

pytestmark = [pytest.mark.timeout(60)]


def up_spec(*flags: str):
    return cluster_spec_from_args(build_parser().parse_args(["up", *flags]))


def test_group_flags_resolve_to_shapes() -> None:
    rng = random.Random()
    ranks = rng.choice([2, 4, 6])
    dp = rng.choice([d for d in range(1, ranks + 1) if ranks % d == 0])
    shape = ("--prefill", "2", "--prefill-ranks", str(ranks), "--decode-ranks", str(ranks), "--dp", str(dp))
    if dp < ranks:  # attention TP (tp > 1): its workers refuse two-batch overlap, and so does `up`
        with pytest.raises(UserError, match="two-batch overlap"):
            up_spec(*shape, "--enable-tbo=decode")
    tbo = dp == ranks
    spec = up_spec(*shape, *(["--enable-tbo=decode"] if tbo else []))
    assert spec.prefill_group == GroupShape(ranks, dp, ranks, enable_tbo=False)
    assert spec.decode_group == GroupShape(ranks, dp, ranks, enable_tbo=tbo)
    assert spec.decode_group.tp * spec.decode_group.dp == ranks
    # Defaults: all ranks data-parallel, experts spread; a single-rank role keeps dp = ep = 1.
    spec = up_spec("--decode-ranks", str(ranks), "--ep", "1", "--enable-tbo")
    assert spec.decode_group == GroupShape(ranks, ranks, 1, enable_tbo=True)
    assert spec.prefill_group == GroupShape(1, 1, 1, enable_tbo=True)
    assert up_spec().prefill_group == up_spec().decode_group == GroupShape()


@pytest.mark.parametrize("flags, words", [
    (["--decode-ranks", "4", "--dp", "3"], "--dp 3 must divide --decode-ranks 4"),
    (["--prefill-ranks", "2", "--decode-ranks", "4", "--dp", "4"], "--dp 4 must divide --prefill-ranks 2"),
    (["--decode-ranks", "4", "--ep", "2"], "--ep 2: a decode group spreads its experts over all --decode-ranks 4"),
    (["--prefill-ranks", "0"], "--prefill-ranks must be >= 1"),
    (["--dp", "2"], "--dp 2 shapes multi-rank workers"),
    (["--ep", "2"], "--ep 2 shapes multi-rank workers"),
    (["--decode-ranks", "2", "--worker-arg=--dp=2"], "--worker-arg=--dp=2: `up` sets the workers' group flags"),
    (["--worker-arg=--enable-tbo"], "use --prefill-ranks/--decode-ranks/--dp/--ep/--enable-tbo"),
])
def test_bad_group_flags_are_clear_errors(flags, words) -> None:
    with pytest.raises(UserError) as caught:
        up_spec(*flags)
    assert words in str(caught.value)


def test_bad_enable_tbo_role_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--enable-tbo=router"])
    assert "invalid choice" in capsys.readouterr().err


def test_port_blocks_are_consecutive_distinct_and_free() -> None:
    rng = random.Random()
    sizes = [rng.randint(1, 8) for _ in range(rng.randint(5, 12))]
    starts = pick_free_port_blocks(sizes)
    ports = [start + k for start, size in zip(starts, sizes) for k in range(size)]
    assert len(ports) == len(set(ports)) == sum(sizes)
    assert all(0 < p < 65536 and is_port_free(p) for p in ports)
    with pytest.raises(ValueError):
        pick_free_port_blocks([2, 0])


def planned(spec, tmp_path: Path):
    roles = spec.roles
    shapes = [spec.group(role) for role in roles]
    plans = plan_workers(roles, shapes, pick_free_port_blocks(port_block_sizes(shapes)))
    settings = ServeSettings(model_dir=str(tmp_path / "model"), served_model_name="tiny", host="127.0.0.1",
                             kv_transport="grpc", device="cpu", secret_file=str(tmp_path / "secret"),
                             worker_args=spec.worker_args)
    return plans, [serve_argv(plan, plans, settings) for plan in plans]


def test_ports_never_collide_across_groups_and_replicas(tmp_path) -> None:
    rng = random.Random()
    spec = up_spec("--prefill", str(rng.randint(2, 3)), "--prefill-ranks", "2",
                   "--decode", str(rng.randint(1, 3)), "--decode-ranks", str(rng.choice([2, 4])))
    plans, _ = planned(spec, tmp_path)
    assert [p.name for p in plans] == [f"prefill-{i}" for i in range(spec.num_prefill)] + \
        [f"decode-{i}" for i in range(spec.num_decode)]
    every = [port for plan in plans for port in plan.ports()]
    assert len(every) == len(set(every)), "two ranks or workers share a port"
    for plan in plans:
        assert len(plan.metrics_ports) == plan.shape.ranks == spec.group(plan.role).ranks


def test_each_serve_command_runs_the_planned_group(tmp_path) -> None:
    """`serve`'s parser and GroupLayout read each command back: one node runs every rank of the
    group, with the planned tp/dp/ep and TBO, on the planned ports; decode may pull from every
    prefill group (its rank 0; the other ranks come from rank 0's Route table)."""
    rng = random.Random()
    ranks = rng.choice([2, 4])
    spec = up_spec("--prefill", "2", "--prefill-ranks", str(ranks), "--decode", "2", "--decode-ranks", "2",
                   "--dp", "2", "--enable-tbo=decode", "--worker-arg=--page-size=4")
    plans, argvs = planned(spec, tmp_path)
    prefill_boots = {f"127.0.0.1:{p.bootstrap_port}" for p in plans if p.role == "prefill"}
    for plan, argv in zip(plans, argvs):
        assert argv[:4] == [sys.executable, "-m", "deepseek_pd.cli", "serve"]
        args = build_parser().parse_args(argv[3:])
        flags = flags_from_args(args)
        par = flags.parallel
        layout = GroupLayout(tp=par.tp, dp=par.dp, ep=par.ep, nnodes=par.nnodes, node_rank=par.node_rank,
                             dist_init_addr=par.dist_init_addr)
        shape = spec.group(plan.role)
        assert flags.role == plan.role
        assert layout.world == shape.ranks and layout.ep == shape.ep and layout.dp == shape.dp
        assert layout.node_ranks == range(shape.ranks), "one `serve` must run every rank of its group"
        assert layout.dist_init_addr == "", "on one node serve picks the rendezvous port itself"
        assert ("enable_tbo=true" in flags.all_engine_options) == (plan.role == "decode")
        assert (flags.port, flags.bootstrap_port) == (plan.port, plan.bootstrap_port)
        metrics = MetricsConfig(flags.host, flags.metrics_port)
        assert [metrics.for_local_rank(r).port for r in range(shape.ranks)] == list(plan.metrics_ports)
        assert flags.page_size == 4
        if plan.role == "decode":
            assert set(flags.prefill_peers) == prefill_boots
        else:
            assert flags.prefill_peers == ()


def test_speculation_reaches_every_worker_of_both_roles(tmp_path) -> None:
    """`up --speculative-num-steps N` (issue 22: `up` sets it like `serve` and the CRD): every worker of
    both roles gets N, read back by `serve`'s parser (a PD pair must agree); out of range is refused."""
    from deepseek_pd.model.speculative.rules import MAX_SPECULATIVE_NUM_STEPS

    rng = random.Random()
    steps = rng.randint(1, MAX_SPECULATIVE_NUM_STEPS)
    spec = up_spec("--prefill", str(rng.randint(1, 2)), "--decode", str(rng.randint(1, 2)), "--decode-ranks", "2",
                   "--speculative-num-steps", str(steps))
    plans, _ = planned(spec, tmp_path)
    settings = ServeSettings(model_dir=str(tmp_path / "model"), served_model_name="tiny", host="127.0.0.1",
                             kv_transport="grpc", device="cpu", secret_file=str(tmp_path / "secret"),
                             speculative_num_steps=spec.speculative_num_steps)
    for plan in plans:
        args = build_parser().parse_args(serve_argv(plan, plans, settings)[3:])
        assert flags_from_args(args).speculative_num_steps == steps, plan.name
    assert up_spec().speculative_num_steps == 0
    for bad in (MAX_SPECULATIVE_NUM_STEPS + 1, -1):
        with pytest.raises(UserError, match="--speculative-num-steps must be an integer"):
            up_spec("--speculative-num-steps", str(bad))


def test_decode_workers_pull_only_from_this_runs_prefill_workers(tmp_path) -> None:
    """Plain `up -P N -D M` (one rank each): every decode `serve` gets `--prefill-peers` naming
    every prefill worker's bootstrap address and nothing else; every worker gets the run's secret."""
    rng = random.Random()
    spec = up_spec("--prefill", str(rng.randint(1, 4)), "--decode", str(rng.randint(1, 3)))
    plans, argvs = planned(spec, tmp_path)
    prefill_boots = sorted(f"127.0.0.1:{p.bootstrap_port}" for p in plans if p.role == "prefill")
    assert len(prefill_boots) == spec.num_prefill
    for plan, argv in zip(plans, argvs):
        flags = flags_from_args(build_parser().parse_args(argv[3:]))
        assert flags.internal_secret_file == str(tmp_path / "secret") and not flags.insecure_internal
        assert argv.count("--prefill-peers") == (plan.role == "decode")
        assert sorted(flags.prefill_peers) == (prefill_boots if plan.role == "decode" else [])


# A stand-in for a group's `serve`: a "rank" child in its process group, then the leader exits as
# a failed group does. A real supervisor stops its ranks first; this one leaves its child behind.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "a").write(f"{child.pid}\\n")
time.sleep(float(sys.argv[2]))
sys.exit(3)
"""


def test_supervisor_kills_a_failed_groups_leftovers_and_restarts_it_whole(tmp_path) -> None:
    pids_file = tmp_path / "ranks"
    group = ManagedProcess("decode-0", [sys.executable, "-c", LEADER, str(pids_file), "0.5"], tmp_path / "g.log")
    router = ManagedProcess("router", [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "r.log")
    group.start()
    router.start()
    supervisor = Supervisor([group], router, "http://127.0.0.1:9", SupervisorConfig(
        initial_backoff_s=0.5, probe_interval_s=1e6))
    try:
        deadline = time.monotonic() + 20
        while not (pids_file.exists() and group.returncode is not None):
            assert time.monotonic() < deadline, group.log_tail()
            time.sleep(0.05)
        first_rank = int(pids_file.read_text().split()[0])
        assert alive({first_rank}), "the stand-in's child should still be running"
        supervisor.step()  # sees the exit: the leftover rank goes at once, a restart is scheduled
        deadline = time.monotonic() + 5
        while alive({first_rank}):
            assert time.monotonic() < deadline, "a failed group's rank outlived it"
            time.sleep(0.05)
        old_leader = group.pid
        deadline = time.monotonic() + 20
        while group.pid == old_leader or len(pids_file.read_text().split()) < 2:
            assert time.monotonic() < deadline, "the group was not restarted"
            supervisor.step()
            time.sleep(0.05)
        assert supervisor.restart_counts == {"decode-0": 1, "router": 0}
        assert alive({int(pids_file.read_text().split()[1])})
    finally:
        from deepseek_pd.launcher.process import stop_all

        stop_all([group, router], 5)


def test_groups_on_cuda_need_a_gpu_per_rank(monkeypatch) -> None:
    import torch

    from deepseek_pd.launcher.gpu_share import check_gpus_for_groups

    gpus = random.randint(1, 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    check_gpus_for_groups("cuda", gpus)
    check_gpus_for_groups("cpu", gpus + 1)  # gloo on CPU: any number of ranks
    with pytest.raises(UserError, match=f"a group of {gpus + 1} ranks runs one rank per GPU, but this machine "
                                        f"has {gpus} GPU"):
        check_gpus_for_groups("cuda:0", gpus + 1)
