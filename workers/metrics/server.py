"""`GET /metrics` of one worker process (`serve --metrics-port`), on its own asyncio loop.

SGLang serves `/metrics` on its HTTP port behind `--enable-metrics`; our workers speak only gRPC,
so the exporter gets a port of its own, off unless `--metrics-port` is given. It runs on the
worker's event loop (aiohttp, already a dependency), so the scrape-time gauges read the engine
on the thread that owns it, exactly as GetLoads does.

A multi-rank group (workers/serve/group_main.py) serves one port per rank: rank r of a node listens on
`port + local_rank` (every series carries `rank`), so ranks never clash and a node's pod exposes
a contiguous range.

`GET /expert_load` on the same port: this rank's expert-load dump (JSON, model/eplb/load_dump.py)
when the runner records it (`--engine-opt record_expert_load=true`), else 404. Per rank, no
collective (the model thread owns those): `deepseek-pd eplb plan` adds the ranks' dumps up.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deepseek_pd.errors import UserError
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricsConfig:
    """Where the exporter listens; `port` None: no exporter (the metrics are still counted)."""

    host: str = "127.0.0.1"
    port: int | None = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port < 65536:
            raise UserError(f"--metrics-port {self.port} is not a TCP port")

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def for_local_rank(self, local_rank: int) -> "MetricsConfig":
        """Rank `local_rank` of a node's group: its own port after the node's first (0 stays 0)."""
        if self.port is None or self.port == 0:
            return self
        port = self.port + local_rank
        if port >= 65536:
            raise UserError(f"--metrics-port {self.port} + local rank {local_rank} is not a TCP port")
        return MetricsConfig(self.host, port)


class MetricsServer:
    """Serves `metrics.registry` at /metrics. `start()` returns the bound port (useful with 0)."""

    def __init__(self, metrics: WorkerMetrics, config: MetricsConfig) -> None:
        self.metrics = metrics
        self.config = config
        self._runner: web.AppRunner | None = None
        self.bound_port = 0

    async def _scrape(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _expert_load(self, request: web.Request) -> web.Response:
        if self.metrics.expert_load is None:
            return web.json_response({"error": "this worker does not record expert load; serve it with "
                                               "--engine-opt record_expert_load=true"}, status=404)
        return web.json_response(self.metrics.expert_load())

    async def start(self) -> int:
        assert self.config.port is not None, "metrics are off"
        app = web.Application()
        app.router.add_get("/metrics", self._scrape)
        app.router.add_get("/expert_load", self._expert_load)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise UserError(f"cannot serve metrics on {self.config.host}:{self.config.port}: {exc.strerror}") from exc
        self.bound_port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor
        log.info("Prometheus metrics on http://%s:%d/metrics", self.config.host, self.bound_port)
        return self.bound_port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
