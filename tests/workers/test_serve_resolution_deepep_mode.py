"""`serve --deepep-mode` end to end in resolution: the mode reaches the runner's dispatch mode (on
`all_to_all` as on `deepep`), the low-latency capacity is sized from the largest step that runs
in that layout or refused when set below it, and CUDA graphs follow the decode layout."""
from __future__ import annotations

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model import runner_config as runner_config_module
from deepseek_pd.model.distributed.dispatch_mode import DEFAULT_LOW_LATENCY_MAX_TOKENS
from test_serve_resolution import checkpoint, resolve


@pytest.fixture
def gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)


@pytest.mark.parametrize("flag, mode", [("none", "normal"), ("normal", "normal"), ("low_latency", "low_latency"),
                                        ("auto", "auto")])
def test_deepep_mode_reaches_the_runner(tmp_path, flag, mode):
    config = resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--dp", "2", "--ep", "2",
                     "--deepep-mode", flag)
    assert (config.runner.dispatcher, config.runner.dispatch_mode) == ("all_to_all", mode)  # no deep_ep here


def test_capacity_is_sized_from_the_decode_batch_cap(tmp_path):
    model = str(checkpoint(tmp_path))
    config = resolve("decode", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--deepep-mode",
                     "auto", "--engine-opt", "max_running_requests=300")
    assert config.runner.low_latency_max_tokens == 300
    # Attention TP: each rank dispatches ceil(300 / 2) of its DP group's rows.
    config = resolve("decode", "--model", model, "--device", "cpu", "--tp", "2", "--ep", "2", "--deepep-mode",
                     "auto", "--engine-opt", "max_running_requests=301")
    assert config.runner.low_latency_max_tokens == 151
    # auto runs extend steps (all a prefill worker runs) in the normal layout: nothing to size.
    config = resolve("prefill", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--deepep-mode",
                     "auto", "--chunked-prefill-size", "4096")
    assert config.runner.low_latency_max_tokens == DEFAULT_LOW_LATENCY_MAX_TOKENS
    # low_latency forces the layout on extend steps too: their chunks must fit.
    config = resolve("prefill", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--deepep-mode",
                     "low_latency", "--chunked-prefill-size", "512")
    assert config.runner.low_latency_max_tokens == 512


def test_capacity_below_the_batch_cap_is_refused(tmp_path):
    model = str(checkpoint(tmp_path))
    with pytest.raises(UserError, match="low_latency_max_tokens=64 is below .* max_running_requests=100 tokens"):
        resolve("decode", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--deepep-mode", "auto",
                "--engine-opt", "max_running_requests=100", "--engine-opt", "low_latency_max_tokens=64")
    with pytest.raises(UserError, match="chunked_prefill_size=512 tokens"):
        resolve("prefill", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--deepep-mode",
                "low_latency", "--chunked-prefill-size", "512", "--engine-opt", "low_latency_max_tokens=128")
    # In the normal layout the capacity is unused, so it is not checked.
    resolve("decode", "--model", model, "--device", "cpu", "--dp", "2", "--ep", "2", "--engine-opt",
            "max_running_requests=100", "--engine-opt", "low_latency_max_tokens=64")


def test_engine_opt_cannot_set_the_dispatch_mode(tmp_path):
    with pytest.raises(UserError, match="--engine-opt dispatch_mode"):
        resolve("decode", "--model", str(checkpoint(tmp_path)), "--device", "cpu", "--engine-opt",
                "dispatch_mode=low_latency")


def test_cuda_graphs_follow_the_decode_layout(gpu_machine, tmp_path):
    model = str(checkpoint(tmp_path))
    for mode in ("auto", "low_latency"):  # decode runs the masked layout: no host sync, graphs on
        assert resolve("decode", "--model", model, "--dp", "2", "--ep", "2", "--deepep-mode", mode).runner.cuda_graph
    for mode in ("none", "normal"):  # decode would wait for the counts on the host
        assert not resolve("decode", "--model", model, "--dp", "2", "--ep", "2", "--deepep-mode",
                           mode).runner.cuda_graph
    with pytest.raises(UserError, match="cuda_graph=true: the EP dispatcher 'all_to_all' is capturable only"):
        resolve("decode", "--model", model, "--dp", "2", "--ep", "2", "--deepep-mode", "normal", "--engine-opt",
                "cuda_graph=true")
