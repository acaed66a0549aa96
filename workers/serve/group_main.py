"""`serve` for a worker that is a group of ranks: one process per rank, stepping in lockstep.

On each node `serve` is the supervisor of that node's ranks (`run_node`): it starts one process
per local rank (on a GPU node: one per GPU, rank = node_rank * local_ranks + local_rank), and when
any of them fails it stops the others and exits non-zero, so the pod fails and Kubernetes (or
`up`) restarts the gang. A node with a single rank runs it in the supervisor's own process.

Stopping (SIGTERM): rank 0 drains the group's requests (they all come through it), then its
lockstep thread sends the stop tick, and every rank ends with `GROUP_STOPPED_EXIT` (0), on every
node. A follower's own SIGTERM only starts a bound (drain timeout + STOP_GRACE_S) within which
rank 0 must stop the group; a rank that leaves otherwise is a failure (`GROUP_FAILED_EXIT`, 3),
which takes the whole group down.

Each rank (`serve_rank`):
    1. joins the group (torch.distributed; rank 0's `--dist-init-addr`, or a free loopback port
       that the supervisor picks on one node)
    2. loads its shard (`ModelRunner` with the EP/TP `ParallelInfo` and the lockstep hook) and builds
       its role's engine around a `LockstepModelThread`; the engine owns this DP rank's KV pool,
       its requests, and (prefill) its own bootstrap service. Under attention TP only each DP
       group's TP rank 0 does; the other TP ranks build no engine and replay its forwards
       (`_serve_tp_follower`, model/distributed/tp_replay.py)
    3. followers serve their engine on an internal SglangScheduler port; every rank's address
       goes to all (`RankGroup.exchange`)
    4. the ticks start; rank 0 serves SglangScheduler for the group on `--port` through a
       `GroupFront` that places each request on one DP rank
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import time
from pathlib import Path

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.workers.serve.builders import BUILDERS
from deepseek_pd.workers.transport.bootstrap_routes import RankEndpoint, RouteTable
from deepseek_pd.workers.metrics.gc_pauses import GcPauses, freeze_startup_heap
from deepseek_pd.workers.group.front import GroupFront
from deepseek_pd.workers.group.lockstep import GROUP_STOPPED_EXIT, LockstepModelThread, exit_group_failed
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.metrics.server import MetricsServer
from deepseek_pd.workers.group.rank_group import RankGroup, join_group
from deepseek_pd.workers.group.remote_engine import RemoteEngine
from deepseek_pd.workers.serve.config import ServeConfig
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer

log = logging.getLogger("deepseek_pd.worker")

STOP_GRACE_S = 10.0  # after one rank ended: how long the others get to exit before SIGKILL


def configure_rank_logging(role: str, rank: int) -> None:
    logging.basicConfig(level=env.log_level(), force=True,
                        format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(name)s: %(message)s")


def rank_config(config: ServeConfig, rank: int) -> ServeConfig:
    """This rank's view of the worker's config: its GPU, its RDMA devices, and (followers) ports
    picked by the OS."""
    layout = config.group
    local_rank = rank - layout.node_ranks.start
    runner = config.runner
    if is_cuda(runner.device):
        runner = dataclasses.replace(runner, device=f"cuda:{local_rank}")
    # Its DP rank: the rooms whose KV it holds (bootstrap_routes.py); rank 0 keeps --port and
    # --bootstrap-port, the others' addresses are exchanged.
    bootstrap = dataclasses.replace(config.worker.bootstrap, dp_rank=layout.dp_rank_of(rank), dp_size=layout.dp,
                                    port=config.worker.bootstrap.port if rank == 0 else 0)
    # Its own RDMA devices (the node's --kv-devices split over its local ranks, serve_resolution.py).
    worker = dataclasses.replace(config.worker, bootstrap=bootstrap,
                                 transport=config.worker.transport.for_local_rank(local_rank))
    return dataclasses.replace(config, runner=runner, worker=worker)


async def serve_rank(config: ServeConfig, rank: int) -> None:
    """Runs one rank until SIGTERM (or until its group breaks: then the process exits non-zero)."""
    layout = config.group
    config = rank_config(config, rank)
    group = await asyncio.to_thread(join_group, layout, rank, config.runner.device)
    holder: list[ModelRunner] = []
    follower = group.is_tp_follower
    # A forward tick without a job of its own: an idle forward, or (TP follower) the leader's forward.
    # (A follower's call says which network it runs; a leader's idle forward is of the step's kind.)
    idle_forward = ((lambda mode, kind: holder[0].follow_one()) if follower
                    else (lambda mode, kind: holder[0].idle(mode, kind)))
    thread = LockstepModelThread(f"{config.role}-model-r{rank}", group.control, idle_forward=idle_forward,
                                 leader=rank == 0, waker=group.waker)
    try:
        check_agreement(await asyncio.to_thread(group.exchange, agreement_of(config)), rank)
        runner = await asyncio.to_thread(ModelRunner, config.runner, parallel=group.parallel(), step_sync=thread,
                                         tp_replay=group.tp_replay())
    except BaseException:
        # Nothing runs on the process groups yet: tear them down now. Left to interpreter
        # shutdown, gloo's teardown at times aborted the process (SIGABRT, "terminate called
        # without an active exception") instead of the start-up error's exit status.
        await asyncio.to_thread(group.close)
        raise
    holder.append(runner)
    if follower:
        await _serve_tp_follower(group, thread, config)
        return
    # Every rank exports its own engine's series (steps, its KV pool, its transfers) on its own
    # port, labelled with its rank; requests are counted once, by rank 0's servicer (the group's).
    metrics = WorkerMetrics(config.metric_labels(rank))
    GcPauses(metrics.observe_gc_pause).install()  # for the life of this rank's process
    engine = BUILDERS[config.role](config, metrics, runner=runner, model_thread=thread)
    metrics.watch_loads(engine.loads)
    exporter = None
    if config.metrics.enabled:
        exporter = MetricsServer(metrics, config.metrics.for_local_rank(rank - layout.node_ranks.start))
        await exporter.start()
    publish_routes = getattr(engine, "publish_routes", None)  # prefill: the ranks' bootstrap endpoints
    if rank == 0 and publish_routes is not None:
        publish_routes(None)  # decode's Route calls wait until every rank's endpoint is known
    await engine.start()
    page_size = config.runner.page_size
    if rank == 0:
        endpoints = await asyncio.to_thread(group.exchange, None)
        leaders = layout.dp_leaders[1:]  # the other DP groups' engines (TP followers run none)
        front = GroupFront([engine] + [RemoteEngine(endpoints[r]["engine"], r, page_size) for r in leaders])
        if publish_routes is not None:
            publish_routes(RouteTable((RankEndpoint("", 0),) + tuple(RankEndpoint(*endpoints[r]["bootstrap"])
                                                                     for r in leaders)))
        await front.start()
        served, server_config = front, config.server
    else:
        served = engine
        server_config = ServerConfig(config.server.host, 0, config.server.drain_timeout_s, config.server.stop_grace_s)
    server = WorkerServer(served, config.model, config.identity, server_config, metrics if rank == 0 else None)
    try:
        if rank > 0:
            port = await server.start()
            host = config.worker.transport.advertise_host
            bootstrap_port = getattr(engine, "bootstrap_port", None)  # prefill ranks: their own endpoint
            await asyncio.to_thread(group.exchange, {"engine": f"{host}:{port}", "bootstrap": (
                None if bootstrap_port is None else (host, bootstrap_port))})
        thread.start()  # every rank is loaded and reachable: the ticks may begin
        freeze_startup_heap()  # before rank 0 takes requests: its full collection is a long pause
        if rank == 0:
            await server.start()
            log.info("group of %d ranks ready (dp %d, tp %d, ep %d, dispatcher %s): rank 0 serves gRPC %s:%d",
                     layout.world, layout.dp, layout.tp, layout.ep, config.runner.dispatcher, config.server.host,
                     server.bound_port)
    except BaseException:
        await served.stop()
        if exporter is not None:
            await exporter.stop()
        raise
    try:
        if rank == 0:  # SIGTERM: drain the group's requests, then the stop tick ends every rank
            server.install_signal_handlers()
            await server.wait_for_shutdown()
            return
        await _follow_until_group_stops(thread, config.server.drain_timeout_s + STOP_GRACE_S)
        await server.shutdown()
        log.info("rank %d: the group stopped; exiting with status %d", rank, GROUP_STOPPED_EXIT)
    finally:
        if exporter is not None:
            await exporter.stop()


async def _serve_tp_follower(group: RankGroup, thread: LockstepModelThread, config: ServeConfig) -> None:
    """An attention-TP follower (TP rank > 0): no engine, no gRPC server; its model thread runs its
    leader's forwards (model/distributed/tp_replay.py) until the group stops. Its metrics port still answers
    (the scrape config lists every rank's port), without request or KV-pool series of its own."""
    rank = group.rank
    exporter = None
    metrics = WorkerMetrics(config.metric_labels(rank))
    GcPauses(metrics.observe_gc_pause).install()  # for the life of this rank's process
    if config.metrics.enabled:
        exporter = MetricsServer(metrics, config.metrics.for_local_rank(rank - group.layout.node_ranks.start))
        await exporter.start()
    try:
        await asyncio.to_thread(group.exchange, None)  # it has no endpoint to offer
        thread.start()
        freeze_startup_heap()
        log.info("rank %d: TP rank %d of DP group %d, replaying rank %d's forwards", rank,
                 group.layout.tp_rank_of(rank), group.dp_rank, group.layout.tp_leader_of(rank))
        await _follow_until_group_stops(thread, config.server.drain_timeout_s + STOP_GRACE_S)
        log.info("rank %d: the group stopped; exiting with status %d", rank, GROUP_STOPPED_EXIT)
    finally:
        if exporter is not None:
            await exporter.stop()


async def _follow_until_group_stops(thread: LockstepModelThread, bound_s: float) -> None:
    """A follower stops only with its group (its requests come through rank 0, which drains
    them): SIGTERM starts a bound, within which rank 0 must stop the group, or this rank exits
    as failed."""
    loop = asyncio.get_running_loop()
    overdue = loop.create_future()

    def on_signal() -> None:
        log.info("signal: this rank stops when rank 0 has drained and stops the group (at most %.0fs)", bound_s)
        if not overdue.done():
            loop.call_later(bound_s, lambda: overdue.done() or overdue.set_result(None))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    stopped = asyncio.ensure_future(asyncio.to_thread(thread.group_stopped.wait))
    await asyncio.wait({stopped, overdue}, return_when=asyncio.FIRST_COMPLETED)
    if not thread.group_stopped.is_set():
        exit_group_failed(f"rank 0 did not stop the group within {bound_s:.0f}s of this rank's SIGTERM")
    overdue.cancel()


def agreement_of(config: ServeConfig) -> dict:
    """What every rank of a group must have resolved alike: a difference changes the sequence or
    the shape of the collectives (dispatcher, DeepEP mode, TBO, the layout), or the model itself."""
    runner = config.runner
    return {"role": config.role, "world": config.group.world, "ep": config.group.ep, "dp": config.group.dp,
            "tp": config.group.tp,
            "deepep_mode": config.group.deepep_mode, "dispatcher": runner.dispatcher,
            # The layouts' collectives differ in shape, the low-latency ones by the capacity.
            "dispatch_mode": runner.dispatch_mode, "low_latency_max_tokens": runner.low_latency_max_tokens,
            "enable_tbo": runner.enable_tbo, "tbo_rules": str(runner.tbo_rules()), "page_size": runner.page_size,
            # Resolved per node (the device and backends found there); capturing runs warm-up and
            # capture forwards, all-to-alls included, once per batch size at start-up.
            "cuda_graph_buckets": runner.cuda_graph_config().buckets() if runner.cuda_graph else None,
            "dtype": str(runner.dtype),
            "model": config.model.served_model_name,
            # EPLB: every rank must route to the same slots and load the same experts into them.
            "ep_num_redundant_experts": runner.ep_num_redundant_experts,
            "expert_location_sha256": _file_sha256(runner.init_expert_location)}


def _file_sha256(path: str | None) -> str | None:
    return None if path is None else hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_agreement(everyone: list[dict], rank: int) -> None:
    """Raises UserError naming the first field in which some rank differs from rank 0."""
    leader = everyone[0]
    for other, theirs in enumerate(everyone):
        for key, value in leader.items():
            if theirs.get(key) != value:
                hint = (" (DeepEP resolves to `deepep` only where deep_ep imports: install it on every node, "
                        "or pass --deepep-mode none everywhere)" if key == "dispatcher" else "")
                raise UserError(f"rank {other} resolved {key}={theirs.get(key)!r} but rank 0 resolved {value!r}: "
                                f"every rank of a group must agree{hint}")


def _rank_process(config: ServeConfig, rank: int) -> None:
    """The body of one spawned rank process."""
    from deepseek_pd.cpu_budget import apply_to_torch
    from deepseek_pd.die_with_parent import die_with_parent

    die_with_parent()  # a SIGKILLed supervisor must not leave ranks behind
    configure_rank_logging(config.role, rank)
    apply_to_torch(processes=len(config.group.node_ranks))  # the node's CPUs shared by its ranks
    try:
        asyncio.run(serve_rank(config, rank))
    except UserError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(2)


def run_node(config: ServeConfig) -> int:
    """Runs this node's ranks of the group; returns the exit status for `serve`."""
    layout = config.group
    if not layout.dist_init_addr:  # one node: rank 0 listens on loopback
        from deepseek_pd.ports import pick_free_ports

        layout = dataclasses.replace(layout, dist_init_addr=f"127.0.0.1:{pick_free_ports(1)[0]}")
        config = dataclasses.replace(config, group=layout)
    ranks = layout.node_ranks
    if len(ranks) == 1:
        configure_rank_logging(config.role, ranks[0])
        asyncio.run(serve_rank(config, ranks[0]))
        return 0
    return _supervise(config, ranks)


def _supervise(config: ServeConfig, ranks: range) -> int:
    context = multiprocessing.get_context("spawn")  # no forked torch/gRPC state
    procs = {rank: context.Process(target=_rank_process, args=(config, rank), name=f"rank{rank}") for rank in ranks}
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()  # SIGTERM: each rank drains and stops

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    for proc in procs.values():
        proc.start()
    log.info("%s worker: started ranks %s (pids %s)", config.role, list(ranks), [p.pid for p in procs.values()])
    by_sentinel = {proc.sentinel: rank for rank, proc in procs.items()}
    first = by_sentinel[multiprocessing.connection.wait(list(by_sentinel))[0]]
    procs[first].join()  # the sentinel is ready before the exit status is reaped
    status = procs[first].exitcode
    group_stopped = status == GROUP_STOPPED_EXIT  # rank 0 drained and stopped the group: all ranks end
    if group_stopped and not stopping:
        log.info("rank %d left with its group (rank 0 stopped it): waiting for the other ranks", first)
    elif not stopping:
        log.error("rank %d exited with status %s: stopping the other ranks of the group", first, status)
    for proc in procs.values():
        if proc.is_alive() and not group_stopped:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    if stopping or group_stopped:
        return GROUP_STOPPED_EXIT
    return status if status and status > 0 else 1  # killed by a signal: a group failure
