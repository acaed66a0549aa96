"""A stand-in for `mooncake.engine.TransferEngine` that opens no socket and writes no byte: it
records every call, so a test can say which one-sided writes a prefill worker would have made.

    engines = install(monkeypatch)   # before building a mooncake sender or receiver
    ... engines[0].writes            # [(session, [local], [remote], [lengths]), ...] per engine

Reads (pulled transfers) do copy, in this process, and only what the real engine would serve:
every remote range inside one buffer the peer engine (found by its session) registered now, and
over RDMA every local range inside one of the reader's own (the NIC lands a READ only in a
registered memory region; over TCP the local side needs none). Anything else returns -1.
"""
from __future__ import annotations

import ctypes
import sys
import types


class StubTransferEngine:
    """The calls `workers/transport/mooncake*.py` make, answered as a healthy engine would."""

    def __init__(self, registry: list["StubTransferEngine"]) -> None:
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []
        self.reads: list[tuple[str, list[int], list[int], list[int]]] = []
        self.registered: dict[int, int] = {}
        self.ever_registered: list[tuple[int, int]] = []  # every registration, in order
        self.hostname = ""
        self.protocol = ""
        self._registry = registry
        self._port = 15000 + len(registry)
        registry.append(self)

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        self.hostname, self.protocol = local_hostname, protocol
        return 0

    def get_rpc_port(self) -> int:
        return self._port

    def _holds(self, addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + size for base, size in self.registered.items())

    def batch_transfer_sync_read(self, session: str, local: list[int], remote: list[int],
                                 lengths: list[int]) -> int:
        self.reads.append((session, list(local), list(remote), list(lengths)))
        peer = next((e for e in self._registry if f"{e.hostname}:{e.get_rpc_port()}" == session), None)
        if peer is None or not all(peer._holds(addr, n) for addr, n in zip(remote, lengths)):
            return -1
        if self.protocol == "rdma" and not all(self._holds(addr, n) for addr, n in zip(local, lengths)):
            return -1
        for dst, src, n in zip(local, remote, lengths):
            _copy(dst, src, n)
        return 0

    def register_memory(self, addr: int, length: int) -> int:
        self.registered[addr] = length
        self.ever_registered.append((addr, length))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.registered.pop(addr, None)
        return 0

    def batch_transfer_sync_write(self, session: str, local: list[int], remote: list[int],
                                  lengths: list[int]) -> int:
        self.writes.append((session, list(local), list(remote), list(lengths)))
        return 0


def _copy(dst: int, src: int, length: int) -> None:
    """`length` bytes from `src` to `dst`, either of them host or CUDA memory (what a CUDA-enabled
    engine's transport does)."""
    import torch

    if torch.cuda.is_available():
        import cupy  # the GPU image ships it

        runtime = cupy.cuda.runtime
        device = getattr(runtime, "memoryTypeDevice", 2)  # (cudaMemoryTypeDevice)
        if any(runtime.pointerGetAttributes(ptr).type == device for ptr in (dst, src)):
            torch.cuda.synchronize()  # (the staging was filled, and is copied out, on torch's streams)
            runtime.memcpy(dst, src, length, runtime.memcpyDefault)
            return
    ctypes.memmove(dst, src, length)


def install(monkeypatch) -> list[StubTransferEngine]:
    """Makes `from mooncake.engine import TransferEngine` give the stub (undone with `monkeypatch`);
    returns the list every engine built from now on joins."""
    engines: list[StubTransferEngine] = []
    package, engine = types.ModuleType("mooncake"), types.ModuleType("mooncake.engine")
    engine.TransferEngine = lambda: StubTransferEngine(engines)
    package.engine = engine
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    return engines
