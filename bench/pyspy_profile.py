"""py-spy on running workers: where a serving step's host time goes.

`start_recording(pid, out)` runs `py-spy record` on one process for a fixed time in speedscope
format (open it at https://www.speedscope.app); `summarize(out)` reads it back into the functions
with the most samples, by self time and by inclusive time, so the answer is readable in a log
without the web viewer. When py-spy is not installed, `pyspy_binary()` is None and the caller
skips profiling with a note. py-spy needs ptrace rights over the target (root or CAP_SYS_PTRACE);
if it lacks them its error is in the returned log.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path


def pyspy_binary() -> str | None:
    beside_python = Path(sys.executable).with_name("py-spy")
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("py-spy")


def start_recording(pid: int, out: Path, duration_s: int = 10, rate: int = 200) -> subprocess.Popen | None:
    """Starts `py-spy record` in the background; None when py-spy is missing."""
    binary = pyspy_binary()
    if binary is None:
        return None
    log = out.with_suffix(".log").open("w")
    argv = [binary, "record", "--pid", str(pid), "--duration", str(duration_s), "--rate", str(rate),
            "--format", "speedscope", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def summarize(path: Path, top: int = 25) -> dict:
    """Top functions by self and by inclusive time, over all threads, as shares of all sampled
    time (py-spy weighs samples in seconds; idle threads are not sampled)."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]

    def label(index: int) -> str:
        frame = frames[index]
        where = os.path.basename(frame.get("file") or "?")
        return f"{frame.get('name', '?')} ({where}:{frame.get('line', '?')})"

    self_time: Counter = Counter()
    total_time: Counter = Counter()
    samples = 0.0
    for profile in doc.get("profiles", []):
        for stack, weight in zip(profile.get("samples", []), profile.get("weights", [])):
            if not stack:
                continue
            samples += weight
            self_time[stack[-1]] += weight
            for index in set(stack):
                total_time[index] += weight
    share = (lambda n: round(n / samples, 4)) if samples else (lambda n: 0.0)
    return {"sampled_s": samples, "threads": len(doc.get("profiles", [])),
            "top_self": [[label(i), share(n)] for i, n in self_time.most_common(top)],
            "top_total": [[label(i), share(n)] for i, n in total_time.most_common(top)]}
