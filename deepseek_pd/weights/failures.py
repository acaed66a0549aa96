"""Why a model could not be made ready: a reason, an exit code, a one-line termination message.

The download init container exits with the reason's code and writes `"<Reason>: <message>"` to
its termination-message file (/dev/termination-log). The kubelet copies that into the pod's
`initContainerStatuses[].state.terminated.message`, and the operator reads it back
(`parse_termination`, operator/model_status.py) into the `ModelReady` condition, so `kubectl get dsd -o yaml`
says "TokenRefused: 401 ..." rather than "Init:CrashLoopBackOff".

    reason            exit  meaning
    TokenRefused        3   the Hub answered 401/403 (missing, wrong or under-privileged token, gated repo)
    RepoNotFound        4   no such repository (404)
    RevisionNotFound    5   no such branch, tag or commit
    ModelNotFound       6   pvc/hostPath: the directory or its config.json is missing
    ChecksumMismatch    7   a downloaded file's sha256/git hash differs from the Hub's listing
    NoSpace             8   the cache volume is full
    NetworkError        9   the Hub could not be reached (after retries)
    DownloadFailed     10   anything else
"""
from __future__ import annotations

from deepseek_pd.errors import UserError

EXIT_CODES = {
    "TokenRefused": 3,
    "RepoNotFound": 4,
    "RevisionNotFound": 5,
    "ModelNotFound": 6,
    "ChecksumMismatch": 7,
    "NoSpace": 8,
    "NetworkError": 9,
    "DownloadFailed": 10,
}
_BY_CODE = {code: reason for reason, code in EXIT_CODES.items()}
MAX_MESSAGE = 1024  # the kubelet keeps at most 4096 bytes of a termination message (all containers: 12 KiB)


class DownloadError(UserError):
    """A model source that cannot be made ready; `reason` is a key of EXIT_CODES."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in EXIT_CODES:
            raise ValueError(f"unknown download failure reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.reason]

    def termination_message(self) -> str:
        """`"<Reason>: <first line of the message>"`, bounded for the kubelet."""
        first = " ".join(self.message.split())
        return f"{self.reason}: {first}"[:MAX_MESSAGE]


def parse_termination(exit_code: int, message: str | None) -> tuple[str, str]:
    """(reason, message) from an init container's terminated state; the exit code decides the
    reason when the message does not start with a known one (e.g. a crash before it was written)."""
    text = (message or "").strip()
    head, sep, rest = text.partition(": ")
    if sep and head in EXIT_CODES:
        return head, rest.strip()
    return _BY_CODE.get(exit_code, "DownloadFailed"), text or f"exit code {exit_code}"
