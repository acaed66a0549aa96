"""The operator's readiness endpoint: `GET /readyz` answers 200 only while it can do its job.

kopf's own `--liveness` endpoint (`/healthz`) answers 200 as soon as the process runs, even when
the API server is unreachable or the token was revoked, so it only says "alive". Ready means:

    kopf has started     its startup handlers ran (login, settings): kopf sets `ready_flag`
    the API answers      a GET of the DeepSeekDeployment API group's discovery document, with
                         the operator's own credentials, succeeds: the server is reachable, the
                         token is accepted and the CRD is served

The answer is cached for `max_age` seconds, so a probe every second costs the API server at most
one request per `max_age`. A 503 body names what is missing, e.g. `api: HTTP 401 Unauthorized`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp.web

PATH = "/readyz"


@dataclass
class Readiness:
    """`ping` raises when the API server cannot be used; anything it raises means not ready."""

    ready_flag: asyncio.Event
    ping: Callable[[], Awaitable[Any]]
    max_age: float = 5.0
    timeout: float = 5.0
    _cached: tuple[float, bool, str] | None = field(default=None, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def check(self) -> tuple[bool, str]:
        """(ready, why)."""
        if not self.ready_flag.is_set():
            return False, "kopf: not started yet"
        async with self._lock:  # parallel probes share one API request
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.max_age:
                return self._cached[1], self._cached[2]
            try:
                await asyncio.wait_for(self.ping(), self.timeout)
                answer = (True, "ok")
            except Exception as exc:  # noqa: BLE001 - any failure is "not ready", with its words
                answer = (False, f"api: {exc or type(exc).__name__}")
            self._cached = (now, *answer)
            return answer


async def serve_readiness(readiness: Readiness, host: str, port: int) -> aiohttp.web.AppRunner:
    """Starts the endpoint; the caller cleans the returned runner up."""

    async def readyz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        ready, why = await readiness.check()
        return aiohttp.web.Response(status=200 if ready else 503, text=why + "\n")

    app = aiohttp.web.Application()
    app.add_routes([aiohttp.web.get(PATH, readyz)])
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner
