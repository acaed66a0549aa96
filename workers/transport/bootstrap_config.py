"""The prefill<->decode bootstrap channel's settings (frozen): where the prefill side listens, who
may dial it, how long each side waits, and the deployment secret that signs its messages."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepseek_pd.bounds import bounds_blocker
from deepseek_pd.errors import UserError
from deepseek_pd.transfer_limits import BOOTSTRAP_BOUNDS
from deepseek_pd.workers.transport.internal_auth import InternalAuth


@dataclass(frozen=True)
class BootstrapConfig:
    """The prefill<->decode channel: where the prefill side listens, and how long anyone waits."""

    host: str = "127.0.0.1"  # bind address of the prefill bootstrap server (0.0.0.0 in a pod)
    port: int = 8998  # 0 picks a free port (tests)
    handshake_timeout_s: float = 30.0  # prefill waits this long for decode's handshake; decode retries this long
    claim_timeout_s: float = 30.0  # a decode handshake waits this long for prefill to get the request
    transfer_timeout_s: float = 300.0  # decode: from handshake to TransferDone (prefill queueing included)
    # prefill: after TransferDone, how long decode may take to accept the KV (its checks included)
    # and half-close; under load this is seconds, and giving up fails a request decode holds.
    confirm_timeout_s: float = 30.0
    event_queue_depth: int = 8  # KV chunks in flight per room before the prefill side waits
    retry_initial_s: float = 0.05  # decode's connect backoff starts here and doubles ...
    retry_max_s: float = 1.0  # ... up to this
    # The deployment secret that signs every handshake/ack/done/abort (internal_auth.py); the
    # default is this process's own random secret, so only engines of one process meet.
    auth: InternalAuth = field(default_factory=InternalAuth)
    # decode: the only prefill bootstrap addresses ("host:port", a host may be a DNS name whose
    # addresses count too) a request may name; () allows loopback hosts only (decode/prefill_peers.py).
    prefill_peers: tuple[str, ...] = ()
    # prefill: names besides host/advertise_host that decode may dial the bootstrap at, and so
    # name in its tokens (a pod's DNS name through its group's headless Service).
    aliases: tuple[str, ...] = ()
    # This engine's DP rank in its worker group, of `dp_size` (bootstrap_routes.py): a prefill rank
    # refuses the handshake of a room that is not its own; a decode rank names itself in its handshakes.
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise UserError(f"bootstrap port {self.port} is not a TCP port")
        if (blocker := bounds_blocker(BOOTSTRAP_BOUNDS, **{name: getattr(self, name)
                                                           for name in BOOTSTRAP_BOUNDS})) is not None:
            raise UserError(blocker)
        if not 0 <= self.dp_rank < self.dp_size:
            raise UserError(f"bootstrap DP rank {self.dp_rank} is not a rank of a group of {self.dp_size}")
