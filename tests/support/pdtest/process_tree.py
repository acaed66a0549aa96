"""Process trees from /proc, for tests that must show no process outlived what it belonged to."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """All live descendants of pid, from /proc (children of children too)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The pids still running (zombies count as gone: they only wait to be reaped)."""
    still = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            still.add(pid)
    return still


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """Waits (bounded) for every pid to end; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


_RANKS_LINE = re.compile(r"started ranks \[([\d, ]+)\] \(pids \[([\d, ]+)\]\)")


def group_rank_pids(log_path: Path) -> dict[int, int]:
    """rank -> pid of a multi-rank `serve`'s latest start, from its log (workers/serve/group_main.py)."""
    found = _RANKS_LINE.findall(log_path.read_text(errors="replace"))
    assert found, f"no 'started ranks' line in {log_path}"
    ranks, pids = found[-1]
    return dict(zip((int(r) for r in ranks.split(",")), (int(p) for p in pids.split(","))))
