"""The body of `deepseek-pd serve`: build the engine, serve it over gRPC, stop cleanly on SIGTERM."""
from __future__ import annotations

import asyncio
import logging

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.workers.common.engine_factory import WorkerOptions, builder_for
from deepseek_pd.workers.common.served_model import ServedModelInfo
from deepseek_pd.workers.common.server import ServerConfig, WorkerServer
from deepseek_pd.workers.common.servicer import WorkerIdentity

logger = logging.getLogger("deepseek_pd.worker")


def configure_logging(role: str) -> None:
    logging.basicConfig(
        level=env.log_level(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")


async def serve_worker(options: WorkerOptions, engine_factory: str | None = None,
                       drain_timeout_s: float = 30.0) -> None:
    info = ServedModelInfo.from_model_dir(options.model_dir, options.served_model_name)
    builder = builder_for(options.role, engine_factory)
    try:
        engine = builder(options)
    except ModuleNotFoundError as exc:
        raise UserError(f"the {options.role} engine is not available in this installation: {exc}") from exc
    if asyncio.iscoroutine(engine):  # builders may need the running loop (e.g. to start tasks)
        engine = await engine
    await _call_maybe_async(getattr(engine, "start", None))
    page_size = engine.loads().extra.get("page_size", options.page_size or 1)  # engines may report it
    identity = WorkerIdentity(role=options.role, kv_transport=options.kv_transport,
                              bootstrap_port=options.bootstrap_port, page_size=int(page_size),
                              host=options.host, port=options.port)
    server = WorkerServer(engine, info, identity,
                          ServerConfig(options.host, options.port, drain_timeout_s=drain_timeout_s))
    server.install_signal_handlers()
    try:
        await server.start()
    except BaseException:
        # The engine already serves its bootstrap port and runs threads: stop them, or the
        # process would linger after reporting the error.
        await _call_maybe_async(getattr(engine, "stop", None) or getattr(engine, "close", None))
        raise
    logger.info("%s worker ready: model %s (served as %r), gRPC %s:%d, bootstrap port %d, "
                "KV transport %s", options.role, info.model_path, info.served_model_name,
                options.host, server.bound_port, options.bootstrap_port, options.kv_transport)
    await server.wait_for_shutdown()


async def _call_maybe_async(fn) -> None:
    if fn is not None:
        result = fn()
        if asyncio.iscoroutine(result):
            await result
