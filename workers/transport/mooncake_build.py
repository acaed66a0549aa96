"""Which Mooncake build this process imported, and whether its TCP transport can move GPU memory.

Mooncake's TCP transport moves a CUDA buffer through host bounce buffers (cudaMemcpy on both ends)
only in its CUDA builds: PyPI `mooncake-transfer-engine` (CUDA 12) and `mooncake-transfer-engine-cuda13`.
The `-non-cuda` wheel hands a GPU address to the socket as if it were host memory, so a GPU pool's
first transfer fails (or worse) long after start-up. `MooncakeEngine` asks here once, at build time,
and refuses that pairing with a message instead.

The build is named by the distribution that installed the module actually imported (two can be on
the path: the GPU session scripts put the CUDA one first), matched by file location:

    imported_build(mooncake.engine) -> MooncakeBuild("mooncake-transfer-engine-cuda13", "0.3.14")
    .moves_cuda_memory_over_tcp     -> True   ("-non-cuda": False; a source build or a stub: None)
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

DISTRIBUTION_PREFIX = "mooncake-transfer-engine"  # every Mooncake engine wheel on PyPI is named so


@dataclass(frozen=True)
class MooncakeBuild:
    """The installed distribution of the imported engine; both None when none installed it (a
    source build on the path, a test's stand-in): then nothing is known about its CUDA support."""

    distribution: str | None
    version: str | None

    @property
    def moves_cuda_memory_over_tcp(self) -> bool | None:
        if self.distribution is None:
            return None
        return "non-cuda" not in self.distribution

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}" if self.distribution else "an unpackaged mooncake build"


def imported_build(engine_module: ModuleType) -> MooncakeBuild:
    """The distribution whose files hold `engine_module` (`mooncake.engine`, already imported)."""
    path = getattr(engine_module, "__file__", None)
    if not path:
        return MooncakeBuild(None, None)
    imported = Path(path).resolve()
    relative = f"{imported.parent.name}/{imported.name}"  # "mooncake/engine.so"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(DISTRIBUTION_PREFIX) and Path(str(dist.locate_file(relative))).resolve() == imported:
            return MooncakeBuild(name, dist.version)
    return MooncakeBuild(None, None)
