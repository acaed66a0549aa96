"""The control-plane build, started in the background as soon as a run has collected tests of
this folder, which then run last: a cold build (Go modules, then about 15 CPU-minutes of compiling
on two cores) overlaps the rest of the suite, which leaves a core idle most of the time, instead
of going before it. The build runs at the lowest CPU priority, so it takes only cycles the tests
leave; the `control_plane` fixture waits for it (BACKGROUND.wait), then asks the build script for
the binaries as before (a no-op once built; the script's lock makes a second build wait).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from control_plane import BUILD_SCRIPT


class BackgroundBuild:
    """At most one background run of scripts/build-control-plane.sh per test process."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self.waited: float | None = None  # seconds the first wait() blocked, once called

    def start(self) -> None:
        if self._proc is not None:
            return
        # nice 9 on top of the script's own 10: the compiler runs at 19, below every test process.
        self._proc = subprocess.Popen(["nice", "-n", "9", "bash", str(BUILD_SCRIPT)], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)

    def wait(self) -> None:
        """Blocks until the build has ended (its own error, if any, comes from the foreground
        call that follows)."""
        if self._proc is None:
            return
        begin = time.monotonic()
        self._proc.wait()
        if self.waited is None:
            self.waited = time.monotonic() - begin

    def stop(self) -> None:
        """Ends a build still running when the session ends (its compiled packages stay in the Go
        build cache, so the next run goes on from there)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()


BACKGROUND = BackgroundBuild()
