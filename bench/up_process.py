"""`deepseek-pd up` as a child process, for benchmarks that must run exactly what users run.

    with UpProcess(UpSpec(model_dir, worker_args=("--device=cuda",), log_dir=out / "logs")) as up:
        url = up.url                       # http://127.0.0.1:PORT once everything is healthy
        pids = up.worker_pids()            # {"prefill-0": 1234, "decode-0": 1235}, e.g. for py-spy

Start-up waits for `up`'s "router ready at URL" line; if `up` exits first or the deadline passes,
the error carries the tail of its log. Stopping sends SIGTERM (`up` then stops the router and the
workers) and SIGKILLs `up`'s process group after the grace period; the workers die with it
(they are started with a parent-death signal).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_READY = re.compile(r"router ready at (\S+)")


@dataclass(frozen=True)
class UpSpec:
    model_dir: Path
    log_dir: Path
    worker_args: tuple[str, ...] = ()
    num_prefill: int = 1
    num_decode: int = 1
    kv_transport: str = "grpc"
    startup_timeout_s: float = 300.0
    stop_grace_s: float = 30.0
    up_args: tuple[str, ...] = ()  # further `up` flags, e.g. ("--policy", "cache_aware")


class UpProcess:
    def __init__(self, spec: UpSpec) -> None:
        self.spec = spec
        self.url: str | None = None
        self._proc: subprocess.Popen | None = None
        self._lines: list[str] = []

    @property
    def argv(self) -> list[str]:
        spec = self.spec
        return [sys.executable, "-m", "deepseek_pd.cli", "up", "--model", str(spec.model_dir),
                "--prefill", str(spec.num_prefill), "--decode", str(spec.num_decode),
                "--kv-transport", spec.kv_transport, "--log-dir", str(spec.log_dir),
                "--startup-timeout", str(int(spec.startup_timeout_s)),
                *[f"--worker-arg={arg}" for arg in spec.worker_args], *spec.up_args]

    @property
    def control_plane_key_file(self) -> Path:
        """The gateway's control-plane key, which `up` writes next to its logs."""
        return self.spec.log_dir / "control-plane-key"

    def start(self) -> str:
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.spec.log_dir / "up.log").open("w")
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                      start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.spec.startup_timeout_s + 10
        while self.url is None:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with code {self._proc.returncode}" if self._proc.poll() is not None
                       else f"not ready after {self.spec.startup_timeout_s:.0f}s")
                self.stop()
                raise RuntimeError(f"`deepseek-pd up` {why}; last lines of {self.spec.log_dir}/up.log:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)
        return self.url

    def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append(line)
            match = _READY.search(line)
            if match and self.url is None:
                self.url = match.group(1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = (self.spec.log_dir / "up.log").read_text(errors="replace")
        except OSError:
            text = ""
        return "\n".join((text + "".join(self._lines)).splitlines()[-lines:])

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def worker_pids(self) -> dict[str, int]:
        """`up`'s worker children by role and index, read from /proc (Linux)."""
        if self._proc is None:
            return {}
        found: dict[str, list[int]] = {"prefill": [], "decode": []}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid != self._proc.pid or b"serve" not in argv:
                continue
            role = argv[argv.index(b"serve") + 1].decode()
            if role in found:
                found[role].append(int(entry.name))
        return {f"{role}-{i}": pid for role, pids in found.items() for i, pid in enumerate(sorted(pids))}

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.spec.stop_grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    def __enter__(self) -> "UpProcess":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
