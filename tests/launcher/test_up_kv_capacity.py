"""`up` reports each worker's KV capacity in tokens once the workers are healthy: what each worker's
memory plan gave it (model/kv/memory_budget.py on a GPU; here, on the CPU, a fixed pool of random size
per run), read back from the worker itself (GetServerInfo) rather than computed by `up`."""
from __future__ import annotations

import logging
import random
import re

import pytest

from pdtest.e2e_cluster import cluster_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_up_logs_each_workers_kv_capacity(tmp_path, caplog) -> None:
    from deepseek_pd.launcher.cluster import LocalCluster

    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    pages, page_size = rng.randint(64, 400), rng.choice([16, 32])
    spec = cluster_spec(tmp_path, extra_worker_args=(f"--num-pages={pages}", f"--page-size={page_size}"))
    with caplog.at_level(logging.INFO, logger="deepseek_pd.launcher.cluster"), LocalCluster(spec):
        pass
    line = next(r.getMessage() for r in caplog.records if "KV capacity" in r.getMessage())
    reported = dict(re.findall(r"(\w+-\d+) ([\d,]+) tokens", line))
    assert reported == {"prefill-0": f"{pages * page_size:,}", "decode-0": f"{pages * page_size:,}"}, line
