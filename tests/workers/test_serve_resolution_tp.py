"""`serve --tp`: attention tensor parallelism reaches the runner, and bad combinations are clear
UserErrors at resolution (heads not divisible, CUDA graphs or TBO asked for with TP)."""
from __future__ import annotations

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.workers.group.layout import GroupLayout
from test_serve_resolution import checkpoint, resolve


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)


def test_tp_and_dp_reach_the_layout_and_the_runner(tmp_path):
    config = resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--tp", "2", "--dp", "2",
                     "--ep", "4")
    assert (config.group.tp, config.group.dp, config.group.world) == (2, 2, 4)
    assert (config.runner.tp_size, config.runner.ep_size) == (2, 4)


def test_tp_not_dividing_the_heads_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--tp 3 .* must divide the model's 4 attention heads"):
        resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--tp", "3")


def test_tp_with_tbo_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="two-batch overlap"):
        resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--tp", "2", "--ep", "2",
                "--enable-tbo")


def test_tp_turns_cuda_graphs_off_and_refuses_them_when_asked(gpu_machine, tmp_path):
    model = str(checkpoint(tmp_path))
    assert resolve("decode", "--model", model, "--dp", "2").runner.cuda_graph  # DP attention: graphs on
    assert not resolve("decode", "--model", model, "--tp", "2").runner.cuda_graph
    with pytest.raises(UserError, match="cuda_graph=true: CUDA graphs are not captured with attention TP"):
        resolve("decode", "--model", model, "--tp", "2", "--engine-opt", "cuda_graph=true")


def test_engine_opt_cannot_set_tp_size(tmp_path):
    with pytest.raises(UserError, match="--engine-opt tp_size"):
        resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--engine-opt", "tp_size=2")


def test_layout_maps_ranks_like_its_docstring():
    layout = GroupLayout(tp=2, dp=4, ep=8)
    assert list(layout.dp_leaders) == [0, 2, 4, 6]
    assert (layout.dp_rank_of(5), layout.tp_rank_of(5), layout.tp_leader_of(5)) == (2, 1, 4)
    flat = GroupLayout(dp=4, ep=4)  # tp 1: every rank its own DP group and its own leader
    assert [flat.tp_leader_of(r) for r in range(4)] == [0, 1, 2, 3] == list(flat.dp_leaders)
