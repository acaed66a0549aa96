"""One Mooncake TransferEngine per worker rank, over a KV pool (workers/transport/mooncake.py says
what each side registers and why): it refuses to start on an address peers cannot reach, and
registers memory only when asked (`register_buffers`), undoing all if one buffer is refused. It never
registers the pool itself: a registered pool is readable and writable by anyone who reaches the
engine's port (Mooncake authenticates no peer), so only stagings are, and only while in use."""
from __future__ import annotations

import importlib
import logging
from typing import Any, Sequence

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.base import TransportConfig
from deepseek_pd.workers.transport.mooncake_build import imported_build

log = logging.getLogger(__name__)


def exposure_warning(host: str) -> str:
    """What to tell whoever starts Mooncake on `host`: its listener is wider than that, and which
    ports a firewall must close (Mooncake 0.3.13.post1 has no bind option: docs/operations.md §8)."""
    ports = env.mooncake_rpc_ports()
    return (f"mooncake's TransferEngine listens on ALL interfaces (0.0.0.0), not only {host}: it binds "
            f"the wildcard whatever address it is given (0.3.13.post1 has no option for it). Its ports, "
            f"drawn from TCP {ports.start}-{ports[-1]} (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), authenticate no "
            f"peer: any caller gets the addresses of the registered stagings (with pulled transfers only the "
            f"prefill workers' send-staging slots in flight), reads them (with the deployment secret only "
            f"ciphertext of their KV) and writes them (failing those requests by their KV MAC). Keep other hosts off {ports.start}-{ports[-1]} (a "
            f"firewall; in Kubernetes the deployment's NetworkPolicy). docs/operations.md, Security")


class MooncakeEngine:
    """One TransferEngine beside a KV pool; nothing is registered until `register_buffers` (a staging)."""

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        try:
            engine_module = importlib.import_module("mooncake.engine")
        except ImportError as exc:
            raise UserError(f"KV transport 'mooncake' is not usable here: {exc} "
                            "(install mooncake-transfer-engine and Debian libibverbs1, or use --kv-transport grpc)"
                            ) from exc
        if config.advertise_host in ("0.0.0.0", "::", ""):
            raise UserError(f"KV transport 'mooncake' needs the address peers reach this worker at, not "
                            f"{config.advertise_host!r}: set the transport's advertise_host (e.g. the pod IP)")
        self.build = imported_build(engine_module)
        if pool.device.type != "cpu" and config.mooncake_protocol == "tcp":
            if self.build.moves_cuda_memory_over_tcp is False:
                raise UserError(f"KV transport 'mooncake' over tcp cannot move a {pool.device} pool with "
                                f"{self.build}: its TCP transport reads and writes host memory only. Install a "
                                f"CUDA build (mooncake-transfer-engine-cuda13, or mooncake-transfer-engine for "
                                f"CUDA 12), or use --kv-transport grpc")
            if self.build.moves_cuda_memory_over_tcp is None:
                log.warning("mooncake over tcp with a %s pool: needs a CUDA-enabled mooncake build (%s)",
                            pool.device, self.build)
        self.engine: Any = engine_module.TransferEngine()
        status = self.engine.initialize(config.advertise_host, "P2PHANDSHAKE",
                                        config.mooncake_protocol, config.mooncake_device)
        if status != 0:
            raise UserError(f"mooncake TransferEngine.initialize({config.advertise_host!r}, P2PHANDSHAKE, "
                            f"{config.mooncake_protocol!r}) failed with status {status}")
        self.protocol = config.mooncake_protocol
        self.session_id = f"{config.advertise_host}:{self.engine.get_rpc_port()}"
        log.info("mooncake TransferEngine %s over %s (devices: %s; %s)", self.session_id, self.protocol,
                 config.mooncake_device or "all", self.build)
        if config.warn_exposure:  # every rank's engine listens so; the node's first rank says it
            log.warning("%s (port %d)", exposure_warning(config.advertise_host), self.engine.get_rpc_port())
        self._registered: list[int] = []

    def register_buffers(self, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Registers buffers until `close`; raises UserError (after undoing all) if one is refused."""
        for addr, length in zip(addrs, lengths):
            if self.engine.register_memory(addr, length) != 0:
                self.close()
                raise UserError(f"mooncake could not register a {length}-byte KV buffer "
                                "(RDMA needs IPC_LOCK and GPUDirect; see docs)")
            self._registered.append(addr)

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()
