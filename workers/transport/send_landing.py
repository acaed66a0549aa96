"""`SendLanding`: a one-sided transfer landed send by send on the decode side, and MACed as it lands.

A Mooncake writer puts a transfer's KV into decode's staging slots (staging.py); decode copies the
slots into the request's private pages, which no writer reaches, and checks the KV MAC over that
copy (kv_mac.py). Done all at once after the TransferDone, the copy and the MAC (one read of the
prompt's KV, ~1 ms of CPU per MB) sat between the last layer's arrival and the first decode step.
So a decode worker asks for each send to be reported as soon as it is written
(`MooncakeDestination.report_sends`: a KVChunk without data naming its layers and pages); each
report's cells are copied out and hashed then (`claim`, the sink's copy, `hash`), beside the
prefill forward, and the check after the TransferDone only digests.

What keeps the failure semantics those of the one-shot check:
- the MAC is still computed on the private copy the model reads, only earlier; a copy is
  complete (synchronised) before its cells are hashed;
- every (layer, page) cell is copied exactly once: a second report of a cell is refused before
  its copy (a copy over a hashed page would let the model read bytes the tag never covered), and
  a transfer that reported some cells must have reported all of them by its TransferDone;
- a report that comes before its send was written (a forged or early one) copies what the slots
  hold then, so the tag does not match and the request fails, as a stranger's write would make it.
A transfer with no report at all (an older prefill worker) is copied and MACed whole after the
TransferDone, as before.

    landing = SendLanding(num_layers=27, num_pages=3)
    landing.begin_mac(pool, pages, key, head, algorithm)   # once the handshake is accepted
    landing.claim(range(0, 1), 0, 2)  -> None          # layer 0 of pages 0-1: the sink copies them,
    landing.hash(range(0, 1), 0, 2)                    # then hashes them
    landing.claim(range(0, 1), 1, 3)  -> "... twice"   # page 1 of layer 0 again: refused
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.kv_mac import LandedMacs


class SendLanding:
    """Which cells of one transfer landed by report, and the MAC of what landed (`begin_mac`)."""

    def __init__(self, num_layers: int, num_pages: int) -> None:
        self._cells = np.zeros((num_layers, num_pages), dtype=bool)
        self.reported = False  # some cell landed by report: every cell must
        self._macs: LandedMacs | None = None

    def begin_mac(self, pool: KVPool, pages: Sequence[int], key: bytes, head: bytes,
                  algorithm: str | None = None) -> None:
        """The transfer is checked with `key` over `head` by `algorithm` (kv_mac.py; None: the
        preferred): hash each landing from now on."""
        self._macs = LandedMacs(pool, pages, key, head, algorithm)

    def claim(self, layers: range, page_begin: int, page_end: int) -> str | None:
        """Records that the sink copies request pages [page_begin, page_end) of `layers` now;
        returns why it must not (cells outside the transfer, or landed already), else None."""
        num_layers, num_pages = self._cells.shape
        if not (0 <= layers.start < layers.stop <= num_layers and 0 <= page_begin < page_end <= num_pages):
            return (f"prefill reported pages [{page_begin}, {page_end}) of layers [{layers.start}, "
                    f"{layers.stop}) written; the transfer has {num_pages} pages of {num_layers} layers")
        cells = self._cells[layers.start:layers.stop, page_begin:page_end]
        if cells.any():
            return (f"prefill reported pages [{page_begin}, {page_end}) of layers [{layers.start}, "
                    f"{layers.stop}) written, some of them twice")
        cells[...] = True
        self.reported = True
        return None

    def hash(self, layers: range, page_begin: int, page_end: int) -> None:
        """After the copy of those cells (complete): hashes them into the MAC, if one is begun."""
        if self._macs is not None:
            self._macs.landed(layers, page_begin, page_end)

    def missing(self) -> str | None:
        """At the TransferDone: why the reports do not cover the transfer, else None."""
        if not self.reported or self._cells.all():
            return None
        return (f"prefill reported {int(self._cells.sum())} of the transfer's {self._cells.size} (layer, page) "
                f"cells written")

    def reads_left(self) -> bool:
        """Whether the MAC check still has pages to read (not begun, or some page not hashed)."""
        return self._macs is None or self._macs.pages_read < self._cells.size

    def take_macs(self, key: bytes, algorithm: str) -> LandedMacs | None:
        """The MAC of what landed, if it was begun with `key` and computes `algorithm` (else None:
        the caller MACs the pages whole); ends its use."""
        macs, self._macs = self._macs, None
        if macs is None or macs.key != key or algorithm != macs.algorithm:
            return None
        return macs
