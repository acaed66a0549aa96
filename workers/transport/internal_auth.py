"""The deployment secret and the HMAC tokens that authenticate the prefill <-> decode channel.

Every worker of one deployment reads the same secret (32 random bytes: `deepseek-pd up` writes it
under its run directory with mode 0600, the operator mounts it from a Kubernetes Secret). Each
bootstrap message that grants something (a Handshake: "send me room R's KV, into these pages";
an AbortRoom; the prefill side's HandshakeAck and TransferDone) carries an `AuthToken`:

    mac = HMAC-SHA256(secret, purpose || context || message serialised with auth.mac empty)

`auth` holds the sender's and the receiver's identity, a timestamp and a 16-byte nonce, so the mac
binds both peers, the room (it is in the message or in `context`), the request id and the time;
the receiver refuses a stale timestamp, a nonce it has seen, or a token issued before the
receiver's guard was made (`ReplayGuard.not_before_ms`: the seen nonces live in memory only, so
without that a restarted prefill would take a handshake captured before its restart). The ack and the
done also carry the handshake's nonce as `challenge`: they answer that stream and no other.

Why HMAC and not mutual TLS (docs/operations.md, "Security"): the router speaks plaintext gRPC to
the workers' SglangScheduler port, so TLS would cover only the bootstrap port; one shared secret
needs no CA, no certificate rotation and no per-pod identities, works the same for `up` on
127.0.0.1 and in Kubernetes, and costs one HMAC per request instead of encrypting every KV byte.
What it does not give by itself: confidentiality of the KV on the wire (the grpc transport's
chunks are plaintext; over mooncake the KV cells are encrypted under `kv_cipher_key`,
transport/kv_cipher.py) and integrity of KV bytes against an on-path attacker who can rewrite an
authenticated TCP stream.

`InternalAuth.insecure()` (`serve --insecure-internal`) turns every check off, with a warning.
Without a secret file, a process gets a random per-process secret: engines in one process (tests,
benches) authenticate each other, and a peer in another process is refused.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.private_file import write_private_file
from deepseek_pd.proto import bootstrap_pb2 as pb

log = logging.getLogger(__name__)

SECRET_BYTES = 32
SECRET_FILE_ENV = env.INTERNAL_SECRET_FILE
_PROCESS_SECRET = secrets.token_bytes(SECRET_BYTES)


class AuthError(Exception):
    """A message's token is missing, forged, stale, replayed or meant for another peer."""


@dataclass(frozen=True)
class InternalAuth:
    """The deployment secret (None: insecure, every check passes) and the token rules."""

    secret: bytes | None = field(default=_PROCESS_SECRET, repr=False)
    max_skew_s: float = 120.0  # clocks of a deployment's hosts agree to well within this

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise UserError(f"the internal secret has {len(self.secret)} bytes; it needs at least 16 "
                            f"(deepseek-pd up and the operator make {SECRET_BYTES})")

    @classmethod
    def insecure(cls) -> "InternalAuth":
        return cls(secret=None)

    @classmethod
    def from_file(cls, path: str | Path) -> "InternalAuth":
        return cls(secret=read_secret_file(path))

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def sign(self, message, purpose: str, sender: str, receiver: str, context: str = "",
             challenge: bytes = b"") -> None:
        """Fills `message.auth` (a fresh nonce, the time, both identities, the mac)."""
        if self.secret is None:
            return
        message.auth.CopyFrom(pb.AuthToken(timestamp_ms=int(time.time() * 1000), nonce=secrets.token_bytes(16),
                                           sender=sender, receiver=receiver, challenge=challenge))
        message.auth.mac = self._mac(message, purpose, context)

    def verify(self, message, purpose: str, context: str = "", challenge: bytes | None = None,
               guard: "ReplayGuard | None" = None) -> pb.AuthToken:
        """Returns the checked token; raises AuthError. `challenge`: the nonce the token must answer."""
        token = message.auth
        if self.secret is None:
            return token
        if not message.HasField("auth") or not token.mac:
            raise AuthError(f"{purpose} carries no authentication token (a peer without the deployment "
                            f"secret, or an older version)")
        if not hmac.compare_digest(token.mac, self._mac(message, purpose, context)):
            raise AuthError(f"{purpose} has a bad authentication token (forged, altered, or signed with "
                            f"another deployment secret)")
        skew = abs(time.time() - token.timestamp_ms / 1000)
        if skew > self.max_skew_s:
            raise AuthError(f"{purpose} is {skew:.0f}s off this host's clock (replayed, or clocks disagree "
                            f"by more than {self.max_skew_s:.0f}s)")
        if challenge is not None:
            self.check_challenge(token, challenge, purpose)
        if guard is not None:
            guard.check(token.nonce, token.timestamp_ms)
        return token

    def check_challenge(self, token: pb.AuthToken, challenge: bytes, purpose: str) -> None:
        """The (already verified) token answers the handshake whose nonce is `challenge`; raises
        AuthError. Apart from `verify` when the challenge is known only after the token is checked."""
        if self.secret is not None and not hmac.compare_digest(token.challenge, challenge):
            raise AuthError(f"{purpose} answers another handshake (replayed from another stream)")

    def kv_key(self, room: int, handshake_nonce: bytes) -> bytes | None:
        """The one-time key of the KV MAC of room `room`'s transfer (kv_transfer/kv_mac.py), bound to
        its handshake; None when insecure (no MAC then)."""
        return self._transfer_key("kv-mac", room, handshake_nonce)

    def kv_cipher_key(self, room: int, handshake_nonce: bytes) -> bytes | None:
        """The one-time key that encrypts room `room`'s KV cells (transport/kv_cipher.py): the MAC
        key's derivation under its own label; None when insecure (the KV then goes in the clear)."""
        return self._transfer_key("kv-cipher", room, handshake_nonce)

    def _transfer_key(self, label: str, room: int, handshake_nonce: bytes) -> bytes | None:
        if self.secret is None:
            return None
        head = f"deepseek-pd/{label}\x00room={room}\x00".encode()
        return hmac.new(self.secret, head + handshake_nonce, hashlib.sha256).digest()

    def _mac(self, message, purpose: str, context: str) -> bytes:
        mac = message.auth.mac
        message.auth.mac = b""
        try:
            body = message.SerializeToString(deterministic=True)
        finally:
            message.auth.mac = mac
        head = f"deepseek-pd/{purpose}\x00{context}\x00".encode()
        return hmac.new(self.secret, head + body, hashlib.sha256).digest()


class ReplayGuard:
    """Nonces seen within the skew window; a second use of one is a replay.

    A nonce is remembered for `2 * window_s` (the skew can go either way), so memory is bounded
    by the message rate times that. Nonces expire in the order they arrived (one fixed lifetime,
    a monotonic clock), so a FIFO of (expiry, nonce) popped from the front keeps expiry at
    amortised O(1) per message: each nonce is added once and forgotten once. `clock` is for tests.

    What it saw is lost when the process (or the server that owns the guard) restarts, so it also
    refuses every token issued before it was made (`not_before_ms`, the wall clock at creation):
    a handshake captured before a restart cannot be replayed after it. This is as exact as the
    hosts' clocks agree: a sender whose clock runs d seconds behind has its tokens refused for the
    first d seconds of a new receiver, and one d seconds ahead could see a token signed in the last
    d seconds before the restart replayed once more.
    """

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic,
                 not_before_ms: int | None = None) -> None:
        self.window_s = window_s
        self._clock = clock
        self.not_before_ms = int(time.time() * 1000) if not_before_ms is None else not_before_ms
        self._seen: set[bytes] = set()
        self._expiries: deque[tuple[float, bytes]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many nonces are remembered now (unexpired, or expired and not yet forgotten)."""
        return len(self._seen)

    def check(self, nonce: bytes, issued_ms: int | None = None) -> None:
        """Remembers `nonce`; raises AuthError if it is short, was seen within the window, or (given
        the token's `issued_ms`) was issued before this guard existed."""
        if len(nonce) < 16:
            raise AuthError("authentication token has no 16-byte nonce")
        if issued_ms is not None and issued_ms < self.not_before_ms:
            raise AuthError(f"authentication token was issued {(self.not_before_ms - issued_ms) / 1000:.3f}s "
                            f"before this worker started (replayed across a restart, or the sender's "
                            f"clock runs behind)")
        now = self._clock()
        with self._lock:
            expiries = self._expiries
            while expiries and expiries[0][0] <= now:
                self._seen.discard(expiries.popleft()[1])
            if nonce in self._seen:
                raise AuthError("authentication token was already used (replay)")
            self._seen.add(nonce)
            expiries.append((now + 2 * self.window_s, nonce))


def read_secret_file(path: str | Path) -> bytes:
    """The secret's bytes; refuses a file other users can read (it authorises KV reads and writes)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read the internal secret file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and not _is_kubernetes_secret_mount(path):
        raise UserError(f"internal secret file {path} is readable by other users (mode {mode & 0o777:o}); "
                        f"chmod 600 it")
    data = data.strip()
    if len(data) < 16:
        raise UserError(f"internal secret file {path} holds {len(data)} bytes; it needs at least 16")
    return data


def _is_kubernetes_secret_mount(path: Path) -> bool:
    """Secret volumes are symlinks into a `..data` directory; their mode is the volume's defaultMode,
    which the operator sets to 0400, but an admin's own mount may differ: the pod is the boundary."""
    return any(part.startswith("..") for part in path.resolve().parts)


def create_secret_file(path: str | Path) -> Path:
    """Writes a fresh random secret (hex text) readable by this user only; returns its path."""
    return write_private_file(path, secrets.token_hex(SECRET_BYTES).encode())


def resolve_auth(secret_file: str | None, insecure: bool) -> InternalAuth:
    """`serve`'s rule: a secret file (flag, else $DEEPSEEK_PD_INTERNAL_SECRET_FILE), or --insecure-internal."""
    secret_file = secret_file or env.internal_secret_file()
    if insecure:
        if secret_file:
            raise UserError("--insecure-internal and an internal secret file contradict each other; pass one")
        log.warning("!!! --insecure-internal: bootstrap and KV messages are NOT authenticated; any host that "
                    "reaches this worker can read or overwrite other requests' KV. For debugging only. !!!")
        return InternalAuth.insecure()
    if not secret_file:
        raise UserError(f"workers need the deployment secret: pass --internal-secret-file (or set "
                        f"{SECRET_FILE_ENV}); `deepseek-pd up` and the operator provide one. "
                        f"--insecure-internal turns authentication off (debugging only)")
    return InternalAuth.from_file(secret_file)
