"""`serve` for a worker that is a group of ranks: one process per rank, stepping in lockstep.

On each node `serve` is the supervisor of that node's ranks (`run_node`): it starts one process
per local rank (on a GPU node: one per GPU, rank = node_rank * local_ranks + local_rank), and when
any of them exits it stops the others and exits non-zero, so the pod fails and Kubernetes (or
`up`) restarts the gang. A node with a single rank runs it in the supervisor's own process.

Each rank (`serve_rank`):
    1. joins the group (torch.distributed; rank 0's `--dist-init-addr`, or a free loopback port
       that the supervisor picks on one node)
    2. loads its shard (`ModelRunner` with the EP `ParallelInfo` and the lockstep hook) and builds
       its role's engine around a `LockstepModelThread`; the engine owns this DP rank's KV pool,
       its requests, and (prefill) its own bootstrap service
    3. followers serve their engine on an internal SglangScheduler port; every rank's address
       goes to all (`RankGroup.exchange`)
    4. the ticks start; rank 0 serves SglangScheduler for the group on `--port` through a
       `GroupFront` that places each request on one DP rank
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import time

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.workers.builders import BUILDERS
from deepseek_pd.workers.common.group_front import GroupFront
from deepseek_pd.workers.common.lockstep import LockstepModelThread
from deepseek_pd.workers.common.metrics import WorkerMetrics
from deepseek_pd.workers.common.metrics_server import MetricsServer
from deepseek_pd.workers.common.rank_group import join_group
from deepseek_pd.workers.common.remote_engine import RemoteEngine
from deepseek_pd.workers.common.serve_config import ServeConfig
from deepseek_pd.workers.common.server import ServerConfig, WorkerServer

log = logging.getLogger("deepseek_pd.worker")

STOP_GRACE_S = 10.0  # after one rank ended: how long the others get to exit before SIGKILL


def configure_rank_logging(role: str, rank: int) -> None:
    logging.basicConfig(level=env.log_level(), force=True,
                        format=f"%(asctime)s {role}[rank {rank}] %(levelname)s %(name)s: %(message)s")


def rank_config(config: ServeConfig, rank: int) -> ServeConfig:
    """This rank's view of the worker's config: its GPU, and (followers) ports picked by the OS."""
    layout = config.group
    local_rank = rank - layout.node_ranks.start
    runner = config.runner
    if is_cuda(runner.device):
        runner = dataclasses.replace(runner, device=f"cuda:{local_rank}")
    worker = config.worker
    if rank > 0:  # rank 0 keeps --port and --bootstrap-port; the others' addresses are exchanged
        worker = dataclasses.replace(worker, bootstrap=dataclasses.replace(worker.bootstrap, port=0))
    return dataclasses.replace(config, runner=runner, worker=worker)


async def serve_rank(config: ServeConfig, rank: int) -> None:
    """Runs one rank until SIGTERM (or until its group breaks: then the process exits non-zero)."""
    layout = config.group
    config = rank_config(config, rank)
    group = await asyncio.to_thread(join_group, layout, rank, config.runner.device)
    holder: list[ModelRunner] = []
    thread = LockstepModelThread(f"{config.role}-model-r{rank}", group.control,
                                 idle_forward=lambda mode: holder[0].idle(mode))
    runner = await asyncio.to_thread(ModelRunner, config.runner, parallel=group.parallel(), step_sync=thread)
    holder.append(runner)
    # Every rank exports its own engine's series (steps, its KV pool, its transfers) on its own
    # port, labelled with its rank; requests are counted once, by rank 0's servicer (the group's).
    metrics = WorkerMetrics(config.metric_labels(rank))
    engine = BUILDERS[config.role](config, metrics, runner=runner, model_thread=thread)
    metrics.watch_loads(engine.loads)
    exporter = None
    if config.metrics.enabled:
        exporter = MetricsServer(metrics, config.metrics.for_local_rank(rank - layout.node_ranks.start))
        await exporter.start()
    await engine.start()
    page_size = config.runner.page_size
    if rank == 0:
        endpoints = await asyncio.to_thread(group.exchange, None)
        front = GroupFront([engine] + [RemoteEngine(address, r, page_size)
                                       for r, address in enumerate(endpoints) if r > 0])
        await front.start()
        served, server_config = front, config.server
    else:
        served = engine
        server_config = ServerConfig(config.server.host, 0, config.server.drain_timeout_s, config.server.stop_grace_s)
    server = WorkerServer(served, config.model, config.identity, server_config, metrics if rank == 0 else None)
    try:
        if rank > 0:
            port = await server.start()
            await asyncio.to_thread(group.exchange, f"{config.worker.transport.advertise_host}:{port}")
        thread.start()  # every rank is loaded and reachable: the ticks may begin
        if rank == 0:
            await server.start()
            log.info("group of %d ranks ready (dp %d, ep %d, dispatcher %s): rank 0 serves gRPC %s:%d",
                     layout.world, layout.world, layout.ep, config.runner.dispatcher, config.server.host,
                     server.bound_port)
    except BaseException:
        await served.stop()
        if exporter is not None:
            await exporter.stop()
        raise
    server.install_signal_handlers()
    try:
        await server.wait_for_shutdown()
    finally:
        if exporter is not None:
            await exporter.stop()


def _rank_process(config: ServeConfig, rank: int) -> None:
    """The body of one spawned rank process."""
    from deepseek_pd.launcher.process import _die_with_parent

    _die_with_parent()  # a SIGKILLed supervisor must not leave ranks behind
    configure_rank_logging(config.role, rank)
    try:
        asyncio.run(serve_rank(config, rank))
    except UserError as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(2)


def run_node(config: ServeConfig) -> int:
    """Runs this node's ranks of the group; returns the exit status for `serve`."""
    layout = config.group
    if not layout.dist_init_addr:  # one node: rank 0 listens on loopback
        from deepseek_pd.launcher.ports import pick_free_ports

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
    if not stopping:
        log.error("rank %d exited with status %s: stopping the other ranks of the group", first, status)
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    if stopping:
        return 0
    return status if status and status > 0 else 1  # a rank that ended on its own is a group failure
