"""Every test process (and the workers it spawns) shares one deployment secret, as `up` would give."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from deepseek_pd.workers.transport.internal_auth import SECRET_FILE_ENV, create_secret_file

if not os.environ.get(SECRET_FILE_ENV):
    os.environ[SECRET_FILE_ENV] = str(create_secret_file(Path(tempfile.mkdtemp(prefix="dspd-secret-")) / "secret"))

# The run's random seed, printed first; every test's draws replay from it (pdtest/seeding.py).
pytest_plugins = ("pdtest.seeding", "pdtest.folder_durations", "pdtest.model_fixtures")  # the time by folder, the model tests' fixtures
