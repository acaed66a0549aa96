"""Every test process (and the workers it spawns) shares one deployment secret, as `up` would give,
and runs torch on one compute thread."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# One torch (OpenMP) thread in the test process and in every worker it starts (they inherit the
# environment; a worker's own cpu_budget leaves a set OMP_NUM_THREADS alone, tests/test_cpu_budget.py
# covers that path). CI runs the suite on two cores that a test's process and its cluster's workers
# share: with a thread per core each, threads spin at OpenMP barriers beside the other processes
# (tests/e2e/test_router_e2e.py took 111 s instead of 44 s, its offline oracle 51 s instead of 2 s,
# on this two-core machine under other load). Set before torch is imported, for every process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from deepseek_pd.workers.transport.internal_auth import SECRET_FILE_ENV, create_secret_file  # noqa: E402 (torch after the line above)

if not os.environ.get(SECRET_FILE_ENV):
    os.environ[SECRET_FILE_ENV] = str(create_secret_file(Path(tempfile.mkdtemp(prefix="dspd-secret-")) / "secret"))

# The run's random seed, printed first; every test's draws replay from it (pdtest/seeding.py).
pytest_plugins = ("pdtest.seeding", "pdtest.folder_durations", "pdtest.model_fixtures")  # the time by folder, the model tests' fixtures
