"""Runs one worker's gRPC server until SIGTERM/SIGINT, then drains and stops it.

Shutdown order, so that no request is cut silently: stop admitting (HealthCheck turns unhealthy,
new Generate calls get UNAVAILABLE, which lets the router pick another worker), wait up to
`drain_timeout_s` for running requests, stop the server with a short grace period (the rest are
cancelled, which aborts them in the engine and frees their pages), then close the engine.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import grpc
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.interface import WorkerEngine
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.api.servicer import SchedulerServicer, WorkerIdentity
from deepseek_pd.workers.api.served_model import ServedModelInfo

logger = logging.getLogger(__name__)

# Prompts of a full 160k context are ~600 KB of token ids; leave headroom for both directions.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30001
    drain_timeout_s: float = 30.0
    stop_grace_s: float = 2.0


class WorkerServer:
    """A started grpc.aio server around one engine. Use `start()`, then `wait_for_shutdown()`."""

    def __init__(self, engine: WorkerEngine, info: ServedModelInfo, identity: WorkerIdentity,
                 config: ServerConfig, metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.servicer = SchedulerServicer(engine, info, identity, metrics)
        self._server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self.bound_port = 0

    async def start(self) -> int:
        """Binds and starts; returns the bound port (useful with port 0)."""
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.so_reuseport", 0)]
        self._server = grpc.aio.server(options=options)
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, self._server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            self.bound_port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise UserError(f"cannot listen on {address}: {exc}") from exc
        await self._server.start()
        logger.info("SglangScheduler serving on %s:%d", self.config.host, self.bound_port)
        return self.bound_port

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def wait_for_shutdown(self) -> None:
        """Blocks until `request_stop()` (or a signal), then shuts down as described above."""
        await self._stop.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        logger.info("shutting down: draining %d running request(s)", self.servicer.num_inflight)
        self.servicer.start_draining()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.servicer.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._server is not None:
            await self._server.stop(self.config.stop_grace_s)
        close = getattr(self.engine, "stop", None) or getattr(self.engine, "close", None)
        if close is not None:  # engines stop their bootstrap service, transports and model thread
            result = close()
            if asyncio.iscoroutine(result):
                await result
        logger.info("stopped")
