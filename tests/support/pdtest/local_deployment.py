"""Runs localized pods (pdtest.local_pods) as processes, as a node would: init containers first,
each to success, then every pod's containers, each in its own session; then stops them all.

    with LocalDeployment(local_pods, logs_dir) as deployment:
        deployment.wait_router_ready(router_url, workers=2, timeout_s=240)
        ...
    # leaving: SIGTERM to each process group, SIGKILL after a grace; no process may outlive it.

Each container is a `deepseek_pd.launcher.process.ManagedProcess` and they stop through the
launcher's `stop_all`, the code `up` stops its workers with; what this adds is the check that
nothing of a pod outlives it (a process that left its container's process group).

A container that exits while the test waits fails it at once with its log (a refused argv exits
with rc 2 at start), never after the whole timeout.
"""
from __future__ import annotations

import os
import pathlib
import signal
import time

from deepseek_pd.launcher.health import router_ready_workers
from deepseek_pd.launcher.process import ManagedProcess, stop_all

from pdtest.local_pods import Command, LocalPod
from pdtest.process_tree import descendants, wait_gone

INIT_TIMEOUT_S = 120
STOP_GRACE_S = 20  # serve drains and stops its ranks on SIGTERM well within this
ORPHAN_WAIT_S = 10


class LocalDeployment:
    def __init__(self, pods: list[LocalPod], logs: pathlib.Path, orphan_wait_s: float = ORPHAN_WAIT_S) -> None:
        """`orphan_wait_s`: how long a stopped pod's processes may take to end before they count as
        orphans (a test that makes one on purpose, alive for a minute, need not wait the default)."""
        self.pods = pods
        self.logs = logs
        self.orphan_wait_s = orphan_wait_s
        self.running: dict[str, ManagedProcess] = {}

    def _log(self, name: str) -> pathlib.Path:
        return self.logs / (name.replace("/", "_") + ".log")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self._log(name)
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name}\n" + "\n".join(text.splitlines()[-lines:])

    def _spawn(self, command: Command) -> ManagedProcess:
        command.cwd.mkdir(parents=True, exist_ok=True)
        proc = ManagedProcess(command.name, command.argv, self._log(command.name),
                              env={**os.environ, **command.env}, cwd=command.cwd)
        proc.start()
        return proc

    def start(self) -> "LocalDeployment":
        self.logs.mkdir(parents=True, exist_ok=True)
        inits = {c.name: self._spawn(c) for pod in self.pods for c in pod.init}  # pods start in parallel
        self.running.update(inits)
        for name, proc in inits.items():
            if not proc.wait(INIT_TIMEOUT_S):
                raise AssertionError(f"init container {name} still running after {INIT_TIMEOUT_S}s")
            del self.running[name]
            assert proc.returncode == 0, f"init container {name} exited {proc.returncode}\n{self.log_tail(name)}"
        for pod in self.pods:
            for command in pod.main:
                self.running[command.name] = self._spawn(command)
        return self

    def check_running(self) -> None:
        """Fails with the container's log if any container has exited."""
        for name, proc in self.running.items():
            assert proc.is_alive(), f"{name} exited with {proc.returncode}\n{self.log_tail(name)}"

    def wait_router_ready(self, router_url: str, workers: int, timeout_s: float) -> None:
        """Until the router's /readiness counts `workers` healthy workers (every group's leader)."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while time.monotonic() < deadline:
            self.check_running()
            seen = router_ready_workers(router_url)
            if seen >= workers:
                return
            time.sleep(0.5)
        tails = "\n".join(self.log_tail(name, 10) for name in self.running)
        raise AssertionError(f"router reports {seen} healthy workers, not {workers}, after {timeout_s:.0f}s\n{tails}")

    def stop(self) -> set[int]:
        """Stops every container (`stop_all`: SIGTERM to its process group, SIGKILL after the
        grace); returns the pids (containers and all their descendants) still alive after that:
        orphans."""
        tree: set[int] = set()
        for proc in self.running.values():
            tree |= descendants(proc.pid) | {proc.pid}
        stop_all(list(self.running.values()), STOP_GRACE_S)
        self.running.clear()
        return wait_gone(tree, self.orphan_wait_s)

    def __enter__(self) -> "LocalDeployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, *exc) -> None:
        left = self.stop()
        for pid in left:  # never leave them to the next test, even when failing it
            _kill(pid)
        assert exc_type is not None or not left, f"processes outlived their pods: {sorted(left)}"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
