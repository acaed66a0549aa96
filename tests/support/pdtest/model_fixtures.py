"""Fixtures the model and engine tests share (pytest plugin, loaded by tests/conftest.py).

- `one_torch_thread`: torch runs on one thread for the module (the CI box has 2 cores shared by
  several test runs); a module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`.
- `module_seed`: one seed for the module's shared fixtures, drawn from the run's seed (pdtest/seeding.py)
  and printed, so a failure names it.
- `tiny_mtp_checkpoint`: the tiny DeepSeek-V3 checkpoint with one MTP layer, made once per module
  from `module_seed`.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def module_seed() -> int:
    value = random.randrange(100_000)
    print(f"seed={value}")
    return value


@pytest.fixture(scope="module")
def tiny_mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory, module_seed: int) -> Path:
    from deepseek_pd.model.checkpoint.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mtp") / "v3", seed=module_seed, mtp_layers=1)
