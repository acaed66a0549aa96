"""`serve --deterministic` reaches the runner and both schedulers, and what it cannot run with is refused."""
from __future__ import annotations

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.workers.serve.roles import ROLES

from test_serve_resolution import checkpoint, resolve  # noqa: E402 (the sibling test module's helpers)


@pytest.mark.parametrize("role", ROLES)
def test_deterministic_reaches_the_runner_and_the_scheduler(role, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = resolve(role, "--model", str(checkpoint(tmp_path)), "--deterministic")
    assert config.runner.deterministic and config.runner.resolved_attention_method == "mha"
    assert config.worker.scheduler.deterministic and not config.worker.scheduler.prefix_cache
    plain = resolve(role, "--model", str(checkpoint(tmp_path, torch_dtype="float32")))
    assert not plain.runner.deterministic and plain.worker.scheduler.prefix_cache


@pytest.mark.parametrize("extra, match", [(("--engine-opt", "prefix_cache=true"), "prefix cache"),
                                          (("--enable-tbo",), "two-batch overlap"),
                                          (("--engine-opt", "moe_backend=grouped"), "no batch-invariant")])
def test_deterministic_refuses_what_it_cannot_keep_invariant(extra, match, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)
    with pytest.raises(UserError, match=match):
        resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cuda", "--deterministic", *extra)
