"""Pure bookkeeping of a transfer: which pages are ready, contiguous runs, chunk shapes.

Nothing here does I/O, so the transports and the prefill scheduler share it and the tests can
check it against plain-Python oracles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PageRun:
    """`length` pages starting at page `src` on the sender and at page `dst` on the receiver."""

    src: int
    dst: int
    length: int


def merge_page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Merges page pairs into runs that are contiguous on both sides, keeping their order.

    Example: src [4, 5, 6, 9], dst [0, 1, 7, 8] -> [PageRun(4, 0, 2), PageRun(6, 7, 1), PageRun(9, 8, 1)].
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for src, dst in zip(src_pages, dst_pages):
        last = runs[-1] if runs else None
        if last is not None and src == last.src + last.length and dst == last.dst + last.length:
            runs[-1] = PageRun(last.src, last.dst, last.length + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs


@dataclass(frozen=True)
class ChunkShape:
    """One message's worth: layers [layer_begin, layer_end) x request pages [page_begin, page_end)."""

    layer_begin: int
    layer_end: int
    page_begin: int
    page_end: int


def split_into_chunks(num_layers: int, page_begin: int, page_end: int, page_bytes: int,
                      max_chunk_bytes: int) -> list[ChunkShape]:
    """Covers layers x pages with chunks of at most `max_chunk_bytes` each.

    Prefers whole layer ranges (several pages of all layers per chunk); when one page of all
    layers is already too big, splits the layers instead. Order: page-major, so the receiver gets
    whole pages early.
    """
    if page_bytes > max_chunk_bytes:
        raise ValueError(f"one page of one layer is {page_bytes} bytes, more than the chunk limit "
                         f"{max_chunk_bytes}; raise max_chunk_bytes or lower page_size")
    chunks: list[ChunkShape] = []
    pages_per_chunk = max_chunk_bytes // (page_bytes * num_layers)
    if pages_per_chunk >= 1:
        for begin in range(page_begin, page_end, pages_per_chunk):
            chunks.append(ChunkShape(0, num_layers, begin, min(begin + pages_per_chunk, page_end)))
        return chunks
    layers_per_chunk = max_chunk_bytes // page_bytes
    for page in range(page_begin, page_end):
        for layer in range(0, num_layers, layers_per_chunk):
            chunks.append(ChunkShape(layer, min(layer + layers_per_chunk, num_layers), page, page + 1))
    return chunks


class SendPlan:
    """Scheduler side of one request's send: which request-local pages may go out now.

    A page may be sent once every token in it is computed; the last, partial page only when the
    whole prompt is (`final=True`). Example, page_size=4, 10-token prompt:
    `ready(3)` -> empty, `ready(8)` -> range(0, 2), `ready(10, final=True)` -> range(2, 3).
    Pages already held by the prefix cache count as computed from the first call.
    """

    def __init__(self, num_tokens: int, page_size: int) -> None:
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.num_pages = -(-num_tokens // page_size)
        self.sent_pages = 0

    def ready(self, computed_tokens: int, final: bool = False) -> range:
        if not 0 <= computed_tokens <= self.num_tokens:
            raise ValueError(f"computed_tokens={computed_tokens} outside [0, {self.num_tokens}]")
        if final and computed_tokens != self.num_tokens:
            raise ValueError(f"final with {computed_tokens} of {self.num_tokens} tokens computed")
        upto = self.num_pages if final else computed_tokens // self.page_size
        pages = range(self.sent_pages, max(upto, self.sent_pages))
        self.sent_pages = max(upto, self.sent_pages)
        return pages

    @property
    def done(self) -> bool:
        return self.sent_pages == self.num_pages
