"""Why a request ended early, as exceptions the engines raise and turn into one `Failed` event.

Every failure carries the `FailureCode` the request ends with (the servicer maps it onto a gRPC
status, proto_convert.STATUS_FOR_FAILURE) and the message the client sees. The subclass says what
happened, so code that must react differently (a transfer that may still be writing into pages,
an abort that needs no retry) can tell them apart without comparing codes:

    AdmissionRefused   the worker cannot take the request now: no KV pages within the admission
                       timeout, or a prompt larger than the pool (RESOURCE_EXHAUSTED)
    RequestAborted     the Abort RPC, a cancelled client, or the peer worker's abort (ABORTED)
    TransferError      the KV transfer or the bootstrap channel failed: handshake timeout, a dead
                       or refusing peer, a corrupt or short stream (any code)

    raise AdmissionRefused("no room for 12 KV pages within 5.0s")
    except RequestFailure as exc: yield Failed(exc.code, exc.message)

`failure_for(code, message)` rebuilds the right subclass from a code that crossed a boundary
(the bootstrap channel's TransferFailed, a room's `peer_gone`), so an abort relayed by the peer is
still a `RequestAborted` here.

`peer_knows` is True when the other side of the transfer reported the failure or is gone, so there
is no one left to tell.
"""
from __future__ import annotations

from deepseek_pd.workers.engine.interface import FailureCode


class RequestFailure(Exception):
    """A request ends with `code` and `message` (what the client's gRPC status says)."""

    def __init__(self, code: FailureCode, message: str, peer_knows: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.peer_knows = peer_knows


class AdmissionRefused(RequestFailure):
    """The worker's KV pool cannot hold the request (now, or within the admission timeout)."""

    def __init__(self, message: str, peer_knows: bool = False) -> None:
        super().__init__(FailureCode.RESOURCE_EXHAUSTED, message, peer_knows)


class RequestAborted(RequestFailure):
    """The request was aborted: Abort RPC, client cancel, or the peer worker gave up on it."""

    def __init__(self, message: str, peer_knows: bool = False) -> None:
        super().__init__(FailureCode.ABORTED, message, peer_knows)


class TransferError(RequestFailure):
    """The KV transfer or the bootstrap channel failed; `code` says how (timeout, peer gone, ...)."""


def failure_for(code: FailureCode, message: str, peer_knows: bool = False) -> RequestFailure:
    """The failure of a request that ended with `code`, by meaning (see the module doc)."""
    if code is FailureCode.ABORTED:
        return RequestAborted(message, peer_knows)
    if code is FailureCode.RESOURCE_EXHAUSTED:
        return AdmissionRefused(message, peer_knows)
    return TransferError(code, message, peer_knows)
