"""The gateway in front of the workers: PyPI `smg` (Shepherd Model Gateway), what `up` and the operator share.

`smg` succeeded sglang-router 0.3.2 and takes the same flags. Both launchers (`deepseek-pd up`,
operator/build_router.py) build its command line from the values here, so a limit or the default
policy is decided once:

    python -m smg.launch_router --pd-disaggregation --prefill grpc://H:P BOOT --decode grpc://H:D
        --policy round_robin --max-payload-size 16777216
        --control-plane-api-keys 'deepseek-pd:deepseek-pd:admin:<key>'     # add/remove workers
        [--api-key <client key>]                                           # the OpenAI/SGLang API

Control plane: with keys set, `/workers` (list, add, remove) answers 401 without
`Authorization: Bearer <key>`; without any key it is open to whoever reaches the port. Client API:
`--api-key` makes every serving route (`/generate`, `/v1/*` except `/v1/models`) need the key;
health routes (`/liveness`, `/readiness`, `/health`) stay open for probes.
"""
from __future__ import annotations

import secrets
from pathlib import Path

from deepseek_pd.errors import UserError

ROUTER_MODULE = "smg.launch_router"

# A whole 160k-token context is ~1.2 MB as JSON token ids and less as text; 16 MiB leaves room
# for long chat histories. smg's own default is 512 MiB: four 50 MB bodies held sglang-router
# 0.3.2 at 8.9 GB resident, and a body over this limit is refused with 413 before it is buffered.
MAX_PAYLOAD_BYTES = 16 * 1024 * 1024

# Both roles, for `up`. Under sglang-router 0.3.2, 3 of 7 bursts of 1,000 concurrent streams
# deadlocked cache_aware's tree while round_robin survived 8 of 8 (FACTS). Not yet re-measured
# under smg: a burst benchmark should confirm or change this choice.
DEFAULT_POLICY = "round_robin"
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")

CONTROL_PLANE_KEY_ID = "deepseek-pd"


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe), for the control plane or a client."""
    return secrets.token_urlsafe(32)


def read_key_file(path: Path | None, flag: str) -> str | None:
    """The one-word key in `path` (a client or control-plane key file), or None without a path."""
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise UserError(f"{flag} {path}: {exc.strerror}") from exc
    if not key or any(c.isspace() for c in key):
        raise UserError(f"{flag} {path}: the key must be one non-empty word")
    return key


def control_plane_key_arg(key: str) -> str:
    """smg's `id:name:role:key` entry giving `key` the admin role on the control plane."""
    if not key or any(c.isspace() for c in key):
        raise ValueError("a control-plane key must be non-empty and have no whitespace")
    return f"{CONTROL_PLANE_KEY_ID}:{CONTROL_PLANE_KEY_ID}:admin:{key}"


def router_security_args(control_plane_key: str, client_api_key: str | None) -> list[str]:
    """Flags that lock the control plane (always) and the client API (when a key is given)."""
    args = ["--control-plane-api-keys", control_plane_key_arg(control_plane_key),
            "--max-payload-size", str(MAX_PAYLOAD_BYTES)]
    if client_api_key:
        args += ["--api-key", client_api_key]
    return args
