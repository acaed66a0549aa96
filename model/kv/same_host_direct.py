"""`TransportConfig.same_host_direct`'s values: whether a same-host KV transfer copies pool to pool.
Torch-free (as kv/staging_size.py, for the same reason) so that `serve`'s engine-option table
(workers/serve/engine_option_keys.py) refuses any other value before a worker starts, and the
transport's config (workers/transport/base.py) checks the same tuple.

grpc transport, same-host peers (workers/transport/direct_pool.py): "auto" copies KV device to
device between CUDA pools, "on" between any pools (a CPU pool only within its own process), "off"
always streams the bytes.
"""
from __future__ import annotations

SAME_HOST_DIRECT_MODES = ("auto", "on", "off")
