"""Keeps a running `LocalCluster` serving: restarts crashed workers and a crashed or hung router.

`deepseek-pd up` calls `Supervisor.step()` about once a second. What it does:

- A worker that exited is started again with the same flags and ports (the router lists it by
  address, and its health checks put it back in rotation once it answers). A multi-rank worker
  is a gang: its `serve` process supervises its ranks, stops all of them when one fails and then
  exits (workers/serve/group_main.py), so it restarts as a whole; whatever is left of its process group
  when it has exited is killed at once, so no rank outlives its group. Restarts back off
  (1 s, 2 s, 4 s, ... up to `max_backoff_s`); a process that stayed up for `stable_after_s`
  starts again from the shortest delay. After `max_restarts` restarts that did not last, the
  process is given up on: `step()` raises `UserError` with its log tail, and `up` stops.
- The router is probed on `/liveness` every `probe_interval_s`. A router that exited, or that
  failed `probe_failures` probes in a row (SIGSTOPped, deadlocked: the kernel still accepts the
  connection, nothing answers), is killed (its whole process group) and started again.
- The router's resident memory (its process group's RSS) is read at every step: past
  `router_max_rss_bytes` it is killed at once and started again, with a warning naming both
  figures. A gateway that swells (smg 1.13 grew by ~1 GB/s on one request with a huge `n`) keeps
  answering `/liveness`, so the probe alone never catches it.
- `on_router_live` (the gateway's guards, gateway_guard.py) runs at the first live probe after
  every router restart, and again at the next probe while it fails.

While one worker is down the others keep serving; requests routed to it fail (and are retried
by the router on another pair, gateway.RETRY_ARGS) until the router's health check takes it out
(2 s locally).
"""
from __future__ import annotations

import logging
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from deepseek_pd.errors import UserError
from deepseek_pd.launcher.process import ManagedProcess

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisorConfig:
    max_restarts: int = 5  # restarts in a row that did not last before giving up on a process
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # up this long: the next crash starts the backoff afresh
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    probe_failures: int = 3  # failed /liveness probes in a row that mean "hung"
    # The router's resident memory that means "swelling": smg idles at ~60 MiB and stayed under
    # a few hundred MiB through bursts of 1,000 streams; a runaway grows by ~1 GB/s.
    router_max_rss_bytes: int = 4 << 30


@dataclass
class _Tracked:
    proc: ManagedProcess
    restarts: int = 0  # restarts in a row that did not last
    started_at: float = 0.0
    restart_at: float | None = None  # when a pending restart is due
    probe_failures: int = 0
    next_probe_at: float = 0.0
    needs_setup: bool = False  # the router restarted and on_router_live has not run since
    events: list[str] = field(default_factory=list)


def router_is_live(base_url: str, timeout_s: float) -> bool:
    """One GET /liveness: True only for a 200 within the timeout."""
    try:
        with urllib.request.urlopen(f"{base_url}/liveness", timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Supervisor:
    """`workers`: processes restarted when they exit; `router`: also restarted when it hangs."""

    def __init__(self, workers: list[ManagedProcess], router: ManagedProcess, router_url: str,
                 config: SupervisorConfig = SupervisorConfig(),
                 clock: Callable[[], float] = time.monotonic,
                 on_router_live: Callable[[], None] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._on_router_live = on_router_live
        now = clock()
        self._workers = [_Tracked(p, started_at=now) for p in workers]
        self._router = _Tracked(router, started_at=now, next_probe_at=now + config.probe_interval_s)
        self._router_url = router_url

    @property
    def restart_counts(self) -> dict[str, int]:
        """Restarts done so far (in a row that did not last), by process name."""
        return {t.proc.name: t.restarts for t in [*self._workers, self._router]}

    def step(self) -> None:
        now = self._clock()
        for tracked in self._workers:
            self._keep_running(tracked, now)
        self._keep_running(self._router, now)
        self._watch_router_memory(now)
        self._probe_router(now)

    # -- one process -------------------------------------------------------------------------
    def _keep_running(self, tracked: _Tracked, now: float) -> None:
        proc = tracked.proc
        if tracked.restart_at is None:
            if proc.is_alive():
                return
            proc.send_signal(signal.SIGKILL)  # leftovers, e.g. a group's ranks, must not serve on alone
            self._schedule_restart(tracked, now, f"exited with code {proc.returncode}")
        if now >= tracked.restart_at:
            self._restart(tracked, now)

    def _schedule_restart(self, tracked: _Tracked, now: float, why: str) -> None:
        cfg, proc = self.config, tracked.proc
        if now - tracked.started_at >= cfg.stable_after_s:
            tracked.restarts = 0
        if tracked.restarts >= cfg.max_restarts:
            raise UserError(f"{proc.name} {why} after {tracked.restarts} restarts; giving up. "
                            f"Last lines of {proc.log_path}:\n{proc.log_tail()}")
        delay = min(cfg.max_backoff_s, cfg.initial_backoff_s * 2 ** tracked.restarts)
        logger.warning("%s %s; restarting it in %.0fs (restart %d of at most %d)", proc.name, why,
                       delay, tracked.restarts + 1, cfg.max_restarts)
        tracked.events.append(why)
        tracked.restart_at = now + delay

    def _restart(self, tracked: _Tracked, now: float) -> None:
        proc = tracked.proc
        proc.send_signal(signal.SIGKILL)  # what is left of the group (a hung router, helpers)
        proc.wait(10.0)
        proc.start()
        tracked.restarts += 1
        tracked.started_at = now
        tracked.restart_at = None
        tracked.probe_failures = 0
        if tracked is self._router:  # give it time to bind before probing again
            tracked.next_probe_at = now + self.config.probe_interval_s * 2
            tracked.needs_setup = self._on_router_live is not None

    def _probe_router(self, now: float) -> None:
        tracked, cfg = self._router, self.config
        if tracked.restart_at is not None or now < tracked.next_probe_at:
            return
        tracked.next_probe_at = now + cfg.probe_interval_s
        if router_is_live(self._router_url, cfg.probe_timeout_s):
            tracked.probe_failures = 0
            if tracked.needs_setup:
                self._set_up_router()
            return
        tracked.probe_failures += 1
        if tracked.probe_failures >= cfg.probe_failures and tracked.proc.is_alive():
            self._schedule_restart(tracked, now, f"did not answer /liveness {tracked.probe_failures} "
                                                 "times in a row (hung)")

    def _set_up_router(self) -> None:
        try:
            self._on_router_live()
        except UserError as error:  # tried again at the next probe; the router serves meanwhile
            logger.warning("router restarted, but setting it up failed (will retry): %s", error)
            return
        self._router.needs_setup = False
        logger.info("router restarted and set up again")

    def _watch_router_memory(self, now: float) -> None:
        tracked, limit = self._router, self.config.router_max_rss_bytes
        if tracked.restart_at is not None:
            return
        rss = tracked.proc.group_rss_bytes()
        if rss <= limit:
            return
        tracked.proc.send_signal(signal.SIGKILL)  # now: it may grow by a GB a second
        self._schedule_restart(tracked, now, f"uses {rss >> 20} MiB of memory, over the bound of "
                                             f"{limit >> 20} MiB (router_max_rss_bytes); killed it")
