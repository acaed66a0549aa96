"""How many compute threads a worker process should run: the CPUs it may use, capped by its
cgroup's CPU quota, shared among the processes of its node.

Why: torch (OpenMP) starts one thread per CPU it sees. In a container the affinity mask is the
node's (say 64 CPUs) while the cgroup quota is the pod's CPU limit (say 2): 64 threads then share 2
CPUs' worth of time and spin at every OpenMP barrier. Measured with the operator's CPU pods
(tests/k8s, a dozen torch processes on 2 cores): two answers of the offline engine took 20.3 s with
2 threads each and 0.8 s with 1. A user's OMP_NUM_THREADS always wins (`apply_to_torch` then does
nothing), as it does for torch itself.

    cpu_budget(processes=1)  # min(affinity, ceil(quota)) // processes, at least 1
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from deepseek_pd import env

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or None where there is none or it cannot be read."""
    try:
        quota, _, period = (root / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100_000)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the count where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_budget(processes: int = 1, root: Path = CGROUP_ROOT, cpus: int | None = None) -> int:
    """Threads for each of `processes` compute processes sharing this cgroup: the usable CPUs, capped
    by the quota rounded up, divided evenly; at least 1."""
    total = usable_cpus() if cpus is None else cpus
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        total = min(total, max(1, math.ceil(quota)))
    return max(1, total // max(1, processes))


def apply_to_torch(processes: int = 1, root: Path = CGROUP_ROOT) -> int | None:
    """Sets torch's intra-op threads to `cpu_budget(processes)` unless the user set OMP_NUM_THREADS;
    returns the count set, or None when the user's setting stands."""
    if env.omp_num_threads() is not None:
        return None
    import torch

    threads = cpu_budget(processes, root)
    if threads != torch.get_num_threads():
        log.info("torch runs %d compute threads (the CPUs and CPU quota of this process%s; "
                 "OMP_NUM_THREADS overrides)", threads, f", shared by {processes} ranks" if processes > 1 else "")
        torch.set_num_threads(threads)
    return threads
