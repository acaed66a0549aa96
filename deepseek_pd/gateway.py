"""The gateway in front of the workers: PyPI `smg` (Shepherd Model Gateway), what `up` and the operator share.

`smg` succeeded sglang-router 0.3.2 and takes the same flags. Both launchers (`deepseek-pd up`,
operator/build_router.py) build its command line from the values here, so a limit or the default
policy is decided once:

    python -m smg.launch_router --pd-disaggregation --prefill grpc://H:P BOOT --decode grpc://H:D
        --policy round_robin --max-payload-size 10485760 --enable-wasm   # + the n guard (gateway_guard)
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

# A whole 160k-token context is ~1.2 MB as JSON token ids and less as text; 10 MiB leaves room
# for long chat histories. smg's own default is 512 MiB: four 50 MB bodies held sglang-router
# 0.3.2 at 8.9 GB resident, and a body over this limit is refused with 413 before it is buffered.
# 10 MiB is also the most smg's WASM middleware reads (gateway_guard), so a body it could not scan
# gets the 413 first.
MAX_PAYLOAD_BYTES = 10 * 1024 * 1024

# Both roles, for `up`. Under sglang-router 0.3.2, 3 of 7 bursts of 1,000 concurrent streams
# deadlocked cache_aware's tree (FACTS). Under smg 1.13, bench/gateway_burst.py (docs/performance.md,
# 2026-12-03, CPU, tiny model) found every policy safe: 2 x 1,000 streams (1P2D) and 2 x 300
# (2P2D) per policy, all completed, none failed or hung, router live, pools drained. TTFT p50/p99
# did not separate the policies beyond the noise of a shared 2-core machine. cache_aware raised the
# prefill prefix-cache hit rate with two prefill workers (27% vs 15% round_robin, 8-9% others):
# that is why the operator, which runs many prefill groups, defaults to it. `up` usually runs one
# prefill worker, where every request meets the same cache whatever the policy, so it keeps the
# stateless, evenly spreading round_robin.
DEFAULT_POLICY = "round_robin"
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")

CONTROL_PLANE_KEY_ID = "deepseek-pd"

# Retries. smg retries a request whose answer is 408/429/500/502/503/504, by running the whole PD
# dispatch again: a fresh prefill/decode pick, a fresh request id (uuid suffix) and a fresh
# bootstrap_room, so the failed attempt's room and KV pages are never touched by the new one
# (each side frees them on the failure; a late peer meets the prefill's tombstone). What makes
# that safe for a user is when the status is decided: a streamed answer starts (200) only once
# both workers' gRPC streams have started, and ours start with their first message, i.e. the
# first token. So a decode worker that dies before the first token fails the attempt (503, or
# 504 after the prefill's handshake timeout) and the request runs again elsewhere; once a token
# has reached the client, a failure is one error event and never a retry (no duplicated tokens).
# An unstreamed answer is sent only when complete, so retrying it is safe at any point. Worker
# answers that are the client's fault (INVALID_ARGUMENT -> 400) are never retried.
# `--retry-max-retries N` is N attempts in all (smg: "max_retries.max(1)" tries; 1 = none).
# The backoff must outlast the health checks that take a dead worker out of rotation (2 s x 2
# locally, 5 s x 3 in Kubernetes): a connect to a dead port fails in a millisecond, so short
# backoffs spend every attempt on the same dead worker (measured: 4 attempts in 1.4 s all met
# "tcp connect error"). 1.5, 3, 6, 8 s (+-20% jitter) give 5 attempts over ~18.5 s.
# smg gives up on a prefill leg that sent nothing for --worker-wedge-secs (default 3 s, stretched by
# the worker's measured prefill throughput, up to 120 s): our prefill worker's first message is the
# first token, so one long prompt, or a queue of them on a fresh or loaded worker, met 504
# "Prefill worker silent" after 3-8.5 s (a 2,400-token prompt on CPU; a 100k-token one on a GPU).
# 30 s keeps a truly wedged worker out of rotation within half a minute (a dead one is found
# sooner by the health checks).
WEDGE_ARGS = ("--worker-wedge-secs", "30")

# Slow clients. smg closes a connection whose request head is not complete within
# --header-read-timeout-secs (default 30 s); a client sends its head at once, so 10 s frees a slot
# held by a slowloris head three times sooner. A slow *body* has no timeout in smg 1.13 (the n guard
# reads it before admission, so it holds a connection but no request slot; neither
# --stream-body-stall-timeout-secs nor --request-timeout-secs closed a stalled body in 30 s), nor is
# there a per-client connection budget: that is the ingress's job (docs/operations.md, "Gateway limits").
SLOW_CLIENT_ARGS = ("--header-read-timeout-secs", "10")

# A per-client request budget: smg 1.13's tenant rate limit (--tenant-rate-limit-enabled with a
# YAML policy). Without --trust-tenant-header a tenant is the client's IP address (or the caller of
# a tenant API key), and every tenant gets `default_policy`'s own token bucket: past it, 429 with
# code tenant_rate_limit_exceeded and Retry-After. tokens_per_minute must be > 0: the u32 maximum
# bounds nothing. Behind an ingress every client has the ingress's address: there the ingress
# bounds clients (or sets a tenant header smg is told to trust).
CLIENT_BUDGET_FILE = "client-budget.yaml"
_NO_TOKEN_BOUND = 2**32 - 1


def client_budget_policy(requests_per_minute: int) -> str:
    """smg's tenant-rate-limit policy YAML: each client (tenant) `requests_per_minute`, tokens unbounded."""
    if requests_per_minute < 1:
        raise UserError(f"a per-client budget of {requests_per_minute} requests per minute admits nothing")
    return (f"default_policy:\n  tokens_per_minute: {_NO_TOKEN_BOUND}\n"
            f"  requests_per_minute: {requests_per_minute}\n")


def client_budget_flags(policy_path: str, client_header: str | None = None) -> tuple[str, ...]:
    """The router flags that load the policy at `policy_path`. `client_header`: the request header
    naming the client, set by an ingress in front (smg then trusts it; without it a client is its
    address, which behind an ingress is the ingress's)."""
    flags = ("--tenant-rate-limit-enabled", "--tenant-rate-limit-config", policy_path)
    if client_header:
        flags += ("--trust-tenant-header", "--tenant-header-name", client_header)
    return flags


def client_budget_args(path: Path, requests_per_minute: int) -> tuple[str, ...]:
    """Writes smg's tenant-rate-limit policy (each client address: `requests_per_minute`) to `path`
    and returns the router flags that load it (`up`)."""
    path.write_text(client_budget_policy(requests_per_minute))
    return client_budget_flags(str(path))

RETRY_ARGS = ("--retry-max-retries", "5", "--retry-initial-backoff-ms", "1500",
              "--retry-backoff-multiplier", "2", "--retry-max-backoff-ms", "8000")


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
