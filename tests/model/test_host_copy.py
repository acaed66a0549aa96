"""`model/host_copy.upload` is the one rule for a host tensor on its way to the device without a
sync, for the model thread and the KV transports alike.

- On the source: no module but `model/host_copy*.py` copies host data to the device through
  page-locked memory it takes itself (`.pin_memory()` or `pin_memory=True` whose buffer is then
  copied to the device). Failed before: workers/transport/host_staging.py kept its own buffers and
  its own `upload`, model/graph_inputs.py and model/speculative/verify_graph.py their own
  `copy_(host.pin_memory(), non_blocking=True)`.
- Which memory each copy reads, on the CPU: a device that is not the CPU is stood in for by
  `meta` (a `.to("meta")` is a copy with no data), `Tensor.pin_memory` is counted, and a thread's
  reserved buffer (CUDA-only: tests/workers/transport/test_host_copy_staging_cuda.py runs the real
  one) is a recording stand-in of its size. The model thread's path pins once per upload, however
  many parts; a thread that reserved buffers never pins.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from deepseek_pd.model import host_copy, host_copy_staging

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("model", "workers", "deepseek_pd")
# Page-locked memory that only the host reads (device -> host, or host-side kernel arguments).
HOST_READ = {"workers/transport/page_io.py": "PageGather's staging slots: device to host",
             "model/kernels/flashinfer_mla.py": "the plan's metadata, which FlashInfer reads on the host"}


def _pins(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            method = isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory"
            keyword = any(k.arg == "pin_memory" for k in node.keywords)
            if method or keyword:
                lines.append(node.lineno)
    return sorted(lines)


def test_only_host_copy_takes_page_locked_memory_for_an_upload() -> None:
    found = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = str(path.relative_to(REPO))
            if ".venv" in path.parts or name.startswith("model/host_copy") or name in HOST_READ:
                continue
            lines = _pins(ast.parse(path.read_text()))
            if lines:
                found[name] = lines
    assert found == {}, f"page-locked uploads outside model/host_copy*.py (use host_copy.upload): {found}"


def test_the_source_check_sees_each_way_to_pin() -> None:
    code = "a.pin_memory().to(d)\nb.copy_(h.pin_memory(), non_blocking=True)\ntorch.empty(3, pin_memory=True)\nx.to(d)"
    assert _pins(ast.parse(code)) == [1, 2, 3]


class _Pins:
    """Counts `Tensor.pin_memory` calls (a CPU-only torch cannot pin: the tensor itself stands in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0

        def pin(tensor: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return tensor
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)


class _Staging:
    """A reserved buffer of `capacity` values: records what it uploads."""

    def __init__(self, capacity: int, dtype: torch.dtype) -> None:
        self.host = torch.empty(capacity, dtype=dtype)
        self.uploaded: list[list[int]] = []

    def upload(self, values: torch.Tensor) -> torch.Tensor:
        assert values.dim() == 1 and values.numel() <= self.host.numel()
        self.uploaded.append(values.tolist())
        return values.to("meta")


def _host(rng: random.Random, dtype: torch.dtype = torch.long) -> torch.Tensor:
    shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 2)))
    return torch.randint(0, 1000, shape).to(dtype)


def test_an_upload_pins_once_in_a_thread_without_reserved_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random()
    pins = _Pins(monkeypatch)
    host = _host(rng)
    on_device = host_copy.upload(host, "meta")
    assert (on_device.device.type, on_device.shape, on_device.dtype, pins.count) == ("meta", host.shape, host.dtype, 1)
    parts = [_host(rng, rng.choice([torch.long, torch.int32, torch.bool])) for _ in range(rng.randint(2, 6))]
    views = host_copy.upload_parts("meta", *parts)
    assert pins.count == 2, "upload_parts: one pinned block for all its parts"
    assert [(v.device.type, v.shape, v.dtype) for v in views] == [("meta", p.shape, p.dtype) for p in parts]
    assert host_copy.upload(host, "cpu") is host and pins.count == 2


def test_a_thread_with_reserved_buffers_never_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random()
    pins = _Pins(monkeypatch)
    capacity = rng.randint(4, 32)
    staging = _Staging(capacity, torch.long)
    monkeypatch.setattr(host_copy_staging._local, "buffers", {("meta", torch.long): staging}, raising=False)
    fits = torch.randint(0, 1000, (rng.randint(1, capacity),))
    assert host_copy.upload(fits, "meta").shape == fits.shape
    assert staging.uploaded == [fits.tolist()]
    matrix = torch.randint(0, 1000, (2, capacity // 2))
    assert host_copy.upload(matrix, "meta").shape == matrix.shape  # reshaped through the flat buffer
    too_large = torch.randint(0, 1000, (capacity + rng.randint(1, 8),))
    other_dtype = torch.randint(0, 1000, (1,), dtype=torch.int32)
    for host in (too_large, other_dtype):  # pageable, rather than make page-locked memory mid-send
        assert host_copy.upload(host, "meta").shape == host.shape
    assert len(staging.uploaded) == 2 and pins.count == 0
