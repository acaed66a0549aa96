"""`PageExposure`: whether a transfer may have put bytes into its destination pages (decode side).

The pages of a transfer that did not pass its checks (failed, refused, aborted) must be zeroed before
another request gets them, but only if something can have been written there; and they must be kept
for the transport's late-write grace only if a write can still land after the transfer ended. Which
of the two holds depends on who writes the pages:

- one-sided transports (fake; the grpc transport's same-host direct copies): the peer writes into
  our memory itself. The pages are
  exposed once it has been told them (`handed_out`: the handshake that lists them goes out), and a
  write it started before it learnt of the failure may land later, within the grace.
- the grpc stream transport and mooncake (whose writers reach only staging slots: the pages are
  written by our own copy, `KVSink.land`; staging.py cools the slots of a failed transfer itself):
  every byte of the pages is written by our own receiver (`wrote`, before it writes
  a chunk into the pages), and nothing writes once it has stopped (the bootstrap client waits for
  its writes before it returns), so there is never a late write.

    transfer                                             may_be_written  late_writes
    refused before the handshake went out (any)          no              no   -> freed at once
    fake: handshake sent, then failed or aborted         yes             yes  -> zeroed after the grace
    mooncake: handshake sent, failed before its copy     no              no   -> freed at once
    mooncake: copied, then its MAC refused               yes             no   -> zeroed, no grace
    grpc: handshake sent, refused before any chunk       no              no   -> freed at once
    grpc: 3 chunks written, then a crc32 mismatch        yes             no   -> zeroed, no grace

The sink of each transfer owns one (`KVSink.exposure`); the transport marks it, the decode engine
reads it when it frees the pages. The flags only ever go from False to True (chunk writers set them
from their threads: a plain attribute store).
"""
from __future__ import annotations


class PageExposure:
    """See the module doc. `one_sided`: the peer writes the pages without us."""

    def __init__(self, one_sided: bool) -> None:
        self.one_sided = one_sided
        self._may_be_written = False

    def handed_out(self) -> None:
        """The peer is being told the pages (the handshake goes out now)."""
        if self.one_sided:
            self._may_be_written = True

    def wrote(self) -> None:
        """Our own receiver is about to write bytes of the transfer into the pages."""
        self._may_be_written = True

    @property
    def may_be_written(self) -> bool:
        """The pages may hold bytes of this transfer: zero them before they are reused."""
        return self._may_be_written

    @property
    def late_writes(self) -> bool:
        """A write may still land after the transfer ended: keep the pages for the late-write grace."""
        return self._may_be_written and self.one_sided
