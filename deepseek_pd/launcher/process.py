"""One supervised child process, in its own process group, logging to a file.

Why a process group per child: a worker or the router may start helpers (the router's Rust
runtime threads are in-process, but Mooncake or a shell wrapper may fork). Signalling the group
reaches all of them. Why PR_SET_PDEATHSIG (set by die_with_parent.py): if the launcher itself is killed with SIGKILL, it
cannot clean up, so the kernel sends each direct child SIGTERM instead, which makes it shut down.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

class ManagedProcess:
    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env  # None: this process's environment
        self.cwd = cwd  # None: this process's working directory
        self._popen: subprocess.Popen | None = None
        # Set once stopped: the group id may be reused by an unrelated process later on.
        self._stopped = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # PR_SET_PDEATHSIG through a wrapper program, not a preexec_fn (die_with_parent.py).
            argv = [sys.executable, "-m", "deepseek_pd.die_with_parent", str(os.getpid()), *self.argv]
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.cwd, start_new_session=True)
        logger.debug("started %s (pid %d): %s", self.name, self.pid, " ".join(self.argv))

    @property
    def pid(self) -> int:
        assert self._popen is not None, "not started"
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def group_rss_bytes(self) -> int:
        """Resident memory of every live process in this child's group (the leader and its
        helpers), from /proc; 0 when not running."""
        if not self.is_alive():
            return 0
        return process_group_rss_bytes(self._popen.pid)

    def log_tail(self, max_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-max_lines:])

    def send_signal(self, sig: int) -> None:
        """Signals the whole process group; a group that is already gone is fine."""
        if self._popen is None or self._stopped:
            return
        try:
            os.killpg(self._popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> bool:
        """True once the leader has exited (and been reaped)."""
        if self._popen is None:
            return True
        try:
            self._popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def process_group_rss_bytes(pgid: int) -> int:
    """The summed VmRSS of the processes whose group id is `pgid` (Linux /proc; a process that
    exits while it is read is skipped)."""
    total_kib = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold spaces
            if int(fields[2]) != pgid:  # field 5 of stat, the process group
                continue
            with open(f"/proc/{entry.name}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"VmRSS:"):
                        total_kib += int(line.split()[1])
                        break
        except (OSError, IndexError, ValueError):
            continue
    return total_kib * 1024


def stop_all(processes: Sequence[ManagedProcess], grace_s: float) -> None:
    """SIGTERM every group, wait up to `grace_s` in total, SIGKILL what is left; leaves no orphan."""
    started = [p for p in processes if p._popen is not None]
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in started:
        if not proc.wait(max(0.0, deadline - time.monotonic())):
            logger.warning("%s did not stop within %.0fs of SIGTERM; killing it", proc.name, grace_s)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10.0)
        # Helpers that left the leader behind (or outlived it) die with the group.
        proc.send_signal(signal.SIGKILL)
        proc._stopped = True
