"""transport/mooncake_build.py: the imported Mooncake engine is named by the distribution that
installed it, and a GPU pool over TCP is refused at build time by a build whose TCP transport cannot
move GPU memory (the `-non-cuda` wheel, the one the CPU tests install), instead of failing at its
first transfer. The real engine module is imported; its TransferEngine class is swapped for the
recording stand-in, so no socket opens."""
from __future__ import annotations

import importlib
import importlib.metadata
import random
import types

import pytest
import torch

from deepseek_pd.errors import UserError
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.mooncake_build import imported_build
from deepseek_pd.workers.transport.mooncake_engine import MooncakeEngine
from pdtest import mooncake_stub

pytestmark = pytest.mark.timeout(60)


def _real_engine_module() -> types.ModuleType:
    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        pytest.skip(f"mooncake is not importable: {exc}")


def test_the_imported_build_is_the_distribution_that_installed_it() -> None:
    module = _real_engine_module()
    build = imported_build(module)
    owners = importlib.metadata.packages_distributions().get("mooncake", [])
    assert build.distribution in {name.lower().replace("_", "-") for name in owners}, (build, owners)
    assert build.version == importlib.metadata.version(build.distribution)
    # A module no distribution installed (a stand-in, a source build) is unknown, not guessed.
    assert imported_build(types.ModuleType("mooncake.engine")).moves_cuda_memory_over_tcp is None


def test_a_gpu_pool_over_tcp_is_refused_by_a_build_that_cannot_move_gpu_memory(monkeypatch) -> None:
    module = _real_engine_module()
    build = imported_build(module)
    if build.moves_cuda_memory_over_tcp is not False:
        pytest.skip(f"the installed build ({build}) moves GPU memory over TCP")
    engines: list = []
    monkeypatch.setattr(module, "TransferEngine", lambda: mooncake_stub.StubTransferEngine(engines))
    rng = random.Random()
    config = TransportConfig(advertise_host=f"127.0.0.{rng.randrange(2, 250)}")
    gpu_pool = types.SimpleNamespace(device=torch.device("cuda", rng.randrange(8)))  # only its device is read
    with pytest.raises(UserError) as refused:
        MooncakeEngine(gpu_pool, config)
    assert build.distribution in str(refused.value) and "mooncake-transfer-engine-cuda13" in str(refused.value)
    assert engines == []  # refused before any engine was started
    # The same build serves a CPU pool over TCP, and a GPU pool over RDMA (the NIC reads GPU memory itself).
    for pool, protocol in [(types.SimpleNamespace(device=torch.device("cpu")), "tcp"), (gpu_pool, "rdma")]:
        MooncakeEngine(pool, TransportConfig(advertise_host=config.advertise_host, mooncake_protocol=protocol)).close()
    assert len(engines) == 2
