"""The bench scripts' tests share one tiny end-to-end run of `bench/serving_gpu.py` (every part)."""
from __future__ import annotations

import pytest

from pdtest.tiny_serving_run import TinyServingRun, run_tiny_serving


@pytest.fixture(scope="session")
def tiny_serving_run(tmp_path_factory: pytest.TempPathFactory) -> TinyServingRun:
    """Run on first use (about a minute; the asking test's timeout must cover it), then reused."""
    return run_tiny_serving(tmp_path_factory.mktemp("serving-gpu-tiny"))
