"""A worker's compute threads (deepseek_pd/cpu_budget.py): the usable CPUs capped by the cgroup's
CPU quota (v2 `cpu.max`, v1 `cfs_quota_us`/`cfs_period_us`), shared by the node's ranks, and the
user's OMP_NUM_THREADS left alone. Oracle: the quota written into a fake cgroup folder, in CPUs."""
from __future__ import annotations

import math
import random

import pytest
import torch

from deepseek_pd import cpu_budget
from deepseek_pd.cpu_budget import apply_to_torch, cgroup_cpu_quota, cpu_budget as budget


def _v2(root, text: str):
    (root / "cpu.max").write_text(text)
    return root


def _v1(root, quota_us: int, period_us: int):
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    return root


def test_quota_is_read_from_either_cgroup_version(tmp_path_factory):
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(20):
        period = rng.choice([50_000, 100_000, 250_000])
        cpus = rng.choice([0.5, 1, 1.5, 2, 3.25, 16])
        quota = int(cpus * period)
        assert cgroup_cpu_quota(_v2(tmp_path_factory.mktemp("v2"), f"{quota} {period}\n")) == pytest.approx(cpus)
        assert cgroup_cpu_quota(_v1(tmp_path_factory.mktemp("v1"), quota, period)) == pytest.approx(cpus)
    assert cgroup_cpu_quota(_v2(tmp_path_factory.mktemp("v2"), "max 100000\n")) is None
    assert cgroup_cpu_quota(_v1(tmp_path_factory.mktemp("v1"), -1, 100_000)) is None  # v1's "no quota"
    assert cgroup_cpu_quota(tmp_path_factory.mktemp("none")) is None
    assert cgroup_cpu_quota(_v2(tmp_path_factory.mktemp("bad"), "lots\n")) is None


def test_budget_is_the_cpus_capped_by_the_quota_shared_by_the_ranks(tmp_path_factory):
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(50):
        cpus, processes = rng.randint(1, 128), rng.choice([1, 1, 2, 4, 8])
        quota = rng.choice([None, rng.choice([0.5, 1.0, 2.0, 2.5, 7.0, 200.0])])
        root = tmp_path_factory.mktemp("cg")
        if quota is not None:
            _v2(root, f"{int(quota * 100_000)} 100000")
        usable = cpus if quota is None else min(cpus, max(1, math.ceil(quota)))
        assert budget(processes, root, cpus=cpus) == max(1, usable // processes), (cpus, processes, quota)


def test_torch_follows_the_budget_unless_the_user_set_omp_threads(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_budget, "usable_cpus", lambda: 64)  # a container on a big node
    root = _v2(tmp_path, "200000 100000")  # its limit: 2 CPUs
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert apply_to_torch(1, root) == 2 and torch.get_num_threads() == 2
        assert apply_to_torch(2, root) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert apply_to_torch(1, root) is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
