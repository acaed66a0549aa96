"""The ranges of the PD handoff's numeric settings (`TransportConfig`, `BootstrapConfig`), torch-free.

The two configs live in workers/transport/, whose package loads the transports (and torch), which
`serve`'s engine-option table (workers/serve/engine_option_keys.py) may not: the CLI, `up` and the
operator check engine options without torch. So the bounds live here, the configs apply them
when they are built, and the table applies the same ones before any worker starts
(deepseek_pd/bounds.py: one rule, one refusal).

Example: `TRANSPORT_BOUNDS["grpc_streams"].blocker("grpc_streams", 17)` ->
"grpc_streams must be in [1, 16], got 17".
"""
from __future__ import annotations

from typing import Mapping

from deepseek_pd.bounds import Bounds

# A KVChunk's data is at most this big (TransportConfig.max_chunk_bytes); both ends size their gRPC
# message limits from it (workers/transport/bootstrap_protocol.py).
MAX_CHUNK_BYTES = 64 << 20
MAX_KV_STREAMS = 16  # parallel KV streams of one room (TransportConfig.grpc_streams)

TRANSPORT_BOUNDS: Mapping[str, Bounds] = {
    "max_chunk_bytes": Bounds(1024, MAX_CHUNK_BYTES),
    "io_threads": Bounds(1),
    "grpc_streams": Bounds(1, MAX_KV_STREAMS),
    "mooncake_staging_tokens": Bounds(1),
    "send_timeout_s": Bounds(0, open_low=True),
}

_TIMEOUT = Bounds(0, open_low=True)

BOOTSTRAP_BOUNDS: Mapping[str, Bounds] = {
    "event_queue_depth": Bounds(1),
    "dp_size": Bounds(1),
    "dp_rank": Bounds(0),  # and below dp_size: BootstrapConfig checks the pair
    **{name: _TIMEOUT for name in ("handshake_timeout_s", "claim_timeout_s", "transfer_timeout_s",
                                   "confirm_timeout_s", "retry_initial_s", "retry_max_s")},
}
