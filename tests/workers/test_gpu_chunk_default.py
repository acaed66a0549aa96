"""`serve`'s default prefill round on a GPU: by the GPU's total memory as SGLang's tiers, read
through NVML without a CUDA context (model/nvml.py); flags win; the CPU keeps 2048."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from deepseek_pd.model import nvml
from deepseek_pd.workers.serve import resolution as serve_resolution
from deepseek_pd.workers.engine.scheduler_config import GPU_CHUNK_TIERS, SchedulerConfig, gpu_chunked_prefill_size

from test_serve_resolution import checkpoint, resolve

GIB = 1 << 30


def _sglang_tier(total_bytes: int) -> int:
    """SGLang's `chunked_prefill_size` default by GPU memory in MiB (server_args.py)."""
    mib = total_bytes / (1 << 20)
    return 2048 if mib < 35 * 1024 else 8192 if mib < 160 * 1024 else 16384


def test_tiers_follow_sglang_and_unknown_memory_keeps_the_default() -> None:
    rng = random.Random()
    sizes = [rng.randrange(1 * GIB, 300 * GIB) for _ in range(200)] + [35 * GIB - 1, 35 * GIB, 160 * GIB - 1,
                                                                        160 * GIB, 141 * 10**9]
    for size in sizes:
        assert gpu_chunked_prefill_size(size) == _sglang_tier(size), size
    assert gpu_chunked_prefill_size(141 * 10**9) == 8192  # the H200
    assert gpu_chunked_prefill_size(None) == SchedulerConfig.chunked_prefill_size


@pytest.fixture
def gpu_of(monkeypatch):
    """A GPU machine whose GPU has the given total memory (None: NVML cannot tell)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from deepseek_pd.model import runner_config as runner_config_module
    monkeypatch.setattr(runner_config_module, "_triton_available", lambda: True)
    asked: list[str] = []

    def set_memory(total: int | None) -> list[str]:
        monkeypatch.setattr(serve_resolution, "total_memory_bytes", lambda device: asked.append(device) or total)
        return asked
    return set_memory


def test_serve_takes_the_tier_of_its_gpu_unless_told(gpu_of, tmp_path) -> None:
    rng = random.Random()
    model = checkpoint(tmp_path)
    role = rng.choice(["prefill", "decode"])
    total = rng.randrange(8 * GIB, 200 * GIB)
    asked = gpu_of(total)
    index = rng.randrange(4)
    config = resolve(role, "--model", str(model), "--device", f"cuda:{index}")
    assert config.worker.scheduler.chunked_prefill_size == _sglang_tier(total)
    assert asked == [f"cuda:{index}"]
    told = rng.randint(1, 50000)
    assert resolve(role, "--model", str(model), "--chunked-prefill-size", str(told)).worker.scheduler \
        .chunked_prefill_size == told
    gpu_of(None)
    assert resolve(role, "--model", str(model)).worker.scheduler.chunked_prefill_size == \
        SchedulerConfig.chunked_prefill_size


def test_the_cpu_keeps_the_default_and_asks_no_gpu(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(serve_resolution, "total_memory_bytes", lambda device: pytest.fail("asked NVML on the CPU"))
    config = resolve("prefill", "--model", str(checkpoint(tmp_path)))
    assert config.worker.scheduler.chunked_prefill_size == SchedulerConfig.chunked_prefill_size


def test_cuda_devices_map_to_nvml_through_cuda_visible_devices() -> None:
    rng = random.Random()
    for _ in range(100):
        n = rng.randint(0, 4)
        assert nvml.visible_device(n, None) == n
        entries = [rng.choice([str(rng.randrange(8)), f"GPU-{uuid.UUID(int=rng.getrandbits(128))}"]) for _ in range(rng.randint(1, 6))]
        visible = ",".join(entries)
        for index in range(len(entries) + 2):
            want = None if index >= len(entries) else int(entries[index]) if entries[index].isdigit() else entries[index]
            assert nvml.visible_device(index, visible) == want
    assert nvml.visible_device(0, f"MIG-{uuid.UUID(int=random.getrandbits(128))}") is None
    assert nvml.visible_device(0, "") is None


def test_no_driver_library_means_unknown(monkeypatch) -> None:
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(nvml.ctypes, "CDLL", refuse)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml.total_memory_bytes("cuda:0") is None


# Measured (NVML's total, CUDA's total) of whole cards: the H100 80GB (2648c43, issue 25).
MEASURED_TOTALS = {"H100 80GB HBM3": (85_520_809_984, 85_017_493_504)}


def _within_the_reservation(nvml_total: int, cuda_total: int) -> bool:
    return cuda_total <= nvml_total <= cuda_total / (1 - nvml.DRIVER_RESERVED_MAX_FRACTION)


def test_the_tier_is_the_same_whichever_total_a_card_reports() -> None:
    """The tiers read NVML's total (SGLang's nvidia-smi figure); CUDA's is smaller by the driver's
    reservation. No tier boundary lies in that band, for measured cards and for any total."""
    for name, (nvml_total, cuda_total) in MEASURED_TOTALS.items():
        assert _within_the_reservation(nvml_total, cuda_total), name
        assert gpu_chunked_prefill_size(nvml_total) == gpu_chunked_prefill_size(cuda_total), name
    rng = random.Random()
    for _ in range(500):
        nvml_total = rng.randrange(1 * GIB, 300 * GIB)
        cuda_total = int(nvml_total * (1 - rng.uniform(0, nvml.DRIVER_RESERVED_MAX_FRACTION)))
        # A reading in the band of a boundary may flip the tier: then the boundary lies in it.
        if gpu_chunked_prefill_size(nvml_total) != gpu_chunked_prefill_size(cuda_total):
            assert any(cuda_total < below <= nvml_total for below, _ in GPU_CHUNK_TIERS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvml_reads_the_whole_card_and_cuda_what_it_can_allocate() -> None:
    """NVML (read with no CUDA context) counts the memory the driver reserves, CUDA does not: NVML's
    total is at least CUDA's and above it by less than the reservation bound, and both give the
    same chunk tier."""
    for index in range(torch.cuda.device_count()):
        nvml_total = nvml.total_memory_bytes(f"cuda:{index}")
        cuda_total = torch.cuda.mem_get_info(index)[1]
        name = torch.cuda.get_device_name(index)
        print(f"{name}: NVML {nvml_total:,} B, CUDA {cuda_total:,} B "
              f"({(nvml_total - cuda_total) / nvml_total:.2%} reserved by the driver)")
        assert cuda_total == torch.cuda.get_device_properties(index).total_memory
        assert _within_the_reservation(nvml_total, cuda_total), (name, nvml_total, cuda_total)
        assert gpu_chunked_prefill_size(nvml_total) == gpu_chunked_prefill_size(cuda_total)
