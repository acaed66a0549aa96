"""The download's progress log: one line every few seconds, readable in `kubectl logs`.

    model download: 12.3 GiB / 642.0 GiB (1.9%), files 3/163, 512.0 MiB/s, ETA 21m
    model download: done, 642.0 GiB in 23m (4 files already present, 1.2 GiB resumed)

Thread-safe: the file downloads of a snapshot run in a thread pool and all add to one counter.
`byte_counter()` adapts it to the progress-bar class that huggingface_hub's `http_get` expects.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from deepseek_pd.units import readable_size as _size

log = logging.getLogger("deepseek_pd.download")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m" if seconds >= 60 else f"{seconds}s"


class ProgressLog:
    """Bytes and files of one snapshot; logs at most every `interval_s` seconds."""

    def __init__(self, total_bytes: int, total_files: int, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._last_log = self._start
        self.done_bytes = 0  # counted towards total: downloaded now, resumed, or already present
        self.fetched_bytes = 0  # downloaded by this run
        self.resumed_bytes = 0
        self.done_files = 0
        self.present_files = 0

    def add_present(self, size: int) -> None:
        """A file that was already complete in the cache."""
        with self._lock:
            self.done_bytes += size
            self.done_files += 1
            self.present_files += 1

    def add_resumed(self, size: int) -> None:
        """Bytes of a partial file kept from an earlier run."""
        with self._lock:
            self.done_bytes += size
            self.resumed_bytes += size

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.done_bytes += num_bytes
            self.fetched_bytes += num_bytes
            now = self._clock()
            due = now - self._last_log >= self.interval_s
            if due:
                self._last_log = now
        if due:
            log.info("%s", self.line())

    def file_done(self) -> None:
        with self._lock:
            self.done_files += 1

    def line(self) -> str:
        elapsed = max(self._clock() - self._start, 1e-9)
        rate = self.fetched_bytes / elapsed
        share = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        eta = f", ETA {_duration((self.total_bytes - self.done_bytes) / rate)}" if rate > 0 else ""
        return (f"model download: {_size(self.done_bytes)} / {_size(self.total_bytes)} ({share:.1f}%), "
                f"files {self.done_files}/{self.total_files}, {_size(rate)}/s{eta}")

    def finish(self) -> str:
        line = (f"model download: done, {_size(self.total_bytes)} in {_duration(self._clock() - self._start)} "
                f"({self.present_files} files already present, {_size(self.resumed_bytes)} resumed)")
        log.info("%s", line)
        return line

    def byte_counter(self) -> type:
        """A class huggingface_hub's `http_get(tqdm_class=...)` can instantiate; its updates land here
        (the `initial` of a resumed request was counted by `add_resumed`)."""
        progress = self

        class _Counter:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def __enter__(self) -> "_Counter":
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def update(self, n: float | None = 1) -> None:
                progress.add(int(n or 0))

            def close(self) -> None:
                pass

        return _Counter
