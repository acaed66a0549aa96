"""Which CUDA stream a worker's model thread issues on (workers/engine/model_stream.py), chosen by
its role (workers/serve/roles.py `kernel_priority`) and `--engine-opt stream_priority`.

CPU-only plumbing: `torch.cuda.Stream` is replaced by a recorder that has the real class's
`priority_range()`/constructor signature, so the test sees which priority each role asks for; that
the priority reaches the kernels is tests/workers/engine/test_model_stream_cuda.py's, and what it
is worth bench/stream_priority.py's.
"""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
import torch

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.model.checkpoint.tiny import tiny_config
from deepseek_pd.workers.engine import model_stream as model_stream_module
from deepseek_pd.workers.engine.model_stream import KernelPriority, model_stream
from deepseek_pd.workers.engine.model_thread import ModelThread
from deepseek_pd.workers.serve.builders import role_model_thread
from deepseek_pd.workers.serve.resolution import resolve_serve_config


class _RecordedStream:
    """Stands in for torch.cuda.Stream: records each stream made and the priority asked for."""

    made: list["_RecordedStream"] = []
    greatest = -1

    def __init__(self, device=None, priority: int = 0) -> None:
        self.device, self.priority = torch.device(device), priority
        _RecordedStream.made.append(self)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, _RecordedStream.greatest


@pytest.fixture
def streams(monkeypatch):
    _RecordedStream.made = []
    _RecordedStream.greatest = -random.Random().randint(1, 5)  # CUDA's range is [greatest, 0], greatest < 0
    monkeypatch.setattr(model_stream_module.torch.cuda, "Stream", _RecordedStream)
    return _RecordedStream


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_config("v2", 512), "torch_dtype": "bfloat16"}))
    return str(tmp_path)


def _resolve(*argv: str):
    return resolve_serve_config(flags_from_args(build_parser().parse_args(["serve", *argv])))


def _cuda_runner(index: int) -> SimpleNamespace:
    """What role_model_thread reads of a runner: the device its model runs on."""
    return SimpleNamespace(model=SimpleNamespace(options=SimpleNamespace(device=torch.device("cuda", index))))


def test_decode_issues_on_the_greatest_priority_and_prefill_stays_on_the_default_stream(model, streams):
    index = random.Random().randrange(8)
    asked = ("--engine-opt", "stream_priority=true")
    threads = {role: role_model_thread(role, _resolve(role, "--model", model, "--device", "cpu", *asked),
                                       _cuda_runner(index))
               for role in ("prefill", "decode")}
    try:
        assert threads["prefill"].stream is None  # the default stream: the least priority already
        assert threads["decode"].stream is streams.made[-1]
        assert (len(streams.made), threads["decode"].stream.priority) == (1, streams.greatest)
        assert threads["decode"].stream.device == torch.device("cuda", index)
    finally:
        for thread in threads.values():
            thread.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_stream_priority_off_keeps_both_roles_on_the_default_stream(model, streams, role):
    default, off = (_resolve(role, "--model", model, "--device", "cpu", *extra)
                    for extra in ((), ("--engine-opt", "stream_priority=false")))
    assert not default.worker.scheduler.stream_priority  # off unless asked: no gain measured (H100)
    for config in (default, off):
        thread = role_model_thread(role, config, _cuda_runner(0))
        thread.close()
        assert thread.stream is None and streams.made == []


def test_the_cpu_has_no_stream_whatever_the_priority(streams):
    assert [model_stream("cpu", priority) for priority in (*KernelPriority, None)] == [None, None, None]
    assert streams.made == []


def test_a_thread_without_a_stream_runs_its_calls_as_before():
    """The CPU path: `stream` None is a no-op around the call (inference mode as always)."""
    thread = ModelThread("test-model")
    try:
        value = random.Random().random()
        seen = asyncio.run(thread.run(lambda x: (x, torch.is_inference_mode_enabled()), value))
    finally:
        thread.close()
    assert seen == (value, True)
