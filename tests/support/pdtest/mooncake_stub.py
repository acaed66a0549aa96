"""A stand-in for `mooncake.engine.TransferEngine` that opens no socket and writes no byte: it
records every call, so a test can say which one-sided writes a prefill worker would have made.

    engines = install(monkeypatch)   # before building a mooncake sender or receiver
    ... engines[0].writes            # [(session, [local], [remote], [lengths]), ...] per engine
"""
from __future__ import annotations

import sys
import types


class StubTransferEngine:
    """The calls `workers/transport/mooncake*.py` make, answered as a healthy engine would."""

    def __init__(self, registry: list["StubTransferEngine"]) -> None:
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []
        self.registered: dict[int, int] = {}
        self.hostname = ""
        registry.append(self)

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        self.hostname = local_hostname
        return 0

    def get_rpc_port(self) -> int:
        return 15000 + len(self.registered)

    def register_memory(self, addr: int, length: int) -> int:
        self.registered[addr] = length
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.registered.pop(addr, None)
        return 0

    def batch_transfer_sync_write(self, session: str, local: list[int], remote: list[int],
                                  lengths: list[int]) -> int:
        self.writes.append((session, list(local), list(remote), list(lengths)))
        return 0


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
