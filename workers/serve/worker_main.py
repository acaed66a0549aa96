"""The body of `deepseek-pd serve`: build the engine, serve it over gRPC, stop cleanly on SIGTERM.

Everything comes resolved in the `ServeConfig` (workers/serve/config.py); this module only
runs it. The builder is the role's default (deepseek_pd.workers.serve.builders) or the test hook's.
"""
from __future__ import annotations

import asyncio
import gc
import logging

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.workers.serve.engine_factory import EngineBuilder
from deepseek_pd.workers.metrics.gc_pauses import GcPauses, freeze_startup_heap
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.metrics.server import MetricsServer
from deepseek_pd.workers.serve.config import ServeConfig
from deepseek_pd.workers.api.server import WorkerServer

logger = logging.getLogger("deepseek_pd.worker")


def configure_logging(role: str) -> None:
    logging.basicConfig(
        level=env.log_level(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


async def serve_worker(config: ServeConfig, builder: EngineBuilder) -> None:
    metrics = WorkerMetrics(config.metric_labels())
    pauses = GcPauses(metrics.observe_gc_pause)
    pauses.install()
    try:
        await _serve(config, builder, metrics)
    finally:
        pauses.uninstall()
        gc.unfreeze()  # a caller that goes on in this process (a test) gets its whole heap collected again


async def _serve(config: ServeConfig, builder: EngineBuilder, metrics: WorkerMetrics) -> None:
    try:
        engine = builder(config, metrics)
    except ModuleNotFoundError as exc:
        raise UserError(f"the {config.role} engine is not available in this installation: {exc}") from exc
    if asyncio.iscoroutine(engine):  # builders may need the running loop (e.g. to start tasks)
        engine = await engine
    metrics.watch_loads(engine.loads)
    await _call_maybe_async(getattr(engine, "start", None))
    freeze_startup_heap()  # before the server takes requests: its full collection is a long pause
    server = WorkerServer(engine, config.model, config.identity, config.server, metrics)
    exporter = MetricsServer(metrics, config.metrics) if config.metrics.enabled else None
    server.install_signal_handlers()
    try:
        if exporter is not None:  # first: a taken metrics port fails before the router sees the worker
            await exporter.start()
        await server.start()
    except BaseException:
        # The engine already serves its bootstrap port and runs threads: stop them, or the
        # process would linger after reporting the error.
        if exporter is not None:
            await exporter.stop()
        await _call_maybe_async(getattr(engine, "stop", None) or getattr(engine, "close", None))
        raise
    ident, runner = config.identity, config.runner
    logger.info("%s worker ready: model %s (served as %r), gRPC %s:%d, bootstrap port %d, KV transport %s, "
                "device %s, dtype %s, page size %d, CUDA graphs %s", config.role, config.model.model_path,
                config.model.served_model_name, ident.host, server.bound_port, ident.bootstrap_port,
                ident.kv_transport, runner.device, runner.dtype, ident.page_size, "on" if runner.cuda_graph else "off")
    try:
        await server.wait_for_shutdown()
    finally:
        if exporter is not None:
            await exporter.stop()


async def _call_maybe_async(fn) -> None:
    if fn is not None:
        result = fn()
        if asyncio.iscoroutine(result):
            await result
