"""`TransportConfig.mooncake_kv_direction`'s values: which way a Mooncake transfer moves the KV.
Torch-free (as same_host_direct.py, for the same reason) so that `serve`'s engine-option table
(workers/serve/engine_option_keys.py) refuses any other value before a worker starts, and the
transport's config (workers/transport/base.py) checks the same tuple.

Set on the decode worker (the prefill side serves either, as the handshake asks):
- "pull" (the default): decode reads the KV out of the prefill worker's send staging (Mooncake
  READ). Decode registers no memory a prefill worker could write over TCP, so a prefill worker that
  holds the deployment secret cannot reach other prefill workers' transfers through decode
  (docs/operations.md, section 8). Needs prefill workers of this version or newer (protocol 3).
- "write": the prefill side writes into decode's registered staging (the older direction): for a
  rolling upgrade from prefill workers that cannot serve a pull, or for comparison in bench/.
"""
from __future__ import annotations

MOONCAKE_KV_DIRECTIONS = ("pull", "write")
