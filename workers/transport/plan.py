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


def split_into_chunks(layers: range, pages: range, page_bytes: int, max_chunk_bytes: int) -> list[ChunkShape]:
    """Covers `layers` x `pages` with chunks of at most `max_chunk_bytes` each.

    Prefers whole layer ranges (several pages of all the layers per chunk, as even as the
    fewest chunks allow); when one page of all the layers is already too big, splits the layers
    instead. Order: page-major. Example, 3 layers, pages [0, 5), a page 100 bytes, limit 600:
    two pages fit a chunk, so three chunks, [0,3)x[0,2), [0,3)x[2,4), [0,3)x[4,5); with pages
    [0, 10) and three pages to a chunk: 3, 3, 2, 2 pages.
    """
    if page_bytes > max_chunk_bytes:
        raise ValueError(f"one page of one layer is {page_bytes} bytes, more than the chunk limit "
                         f"{max_chunk_bytes}; raise max_chunk_bytes or lower page_size")
    chunks: list[ChunkShape] = []
    pages_per_chunk = max_chunk_bytes // (page_bytes * len(layers))
    if pages_per_chunk >= 1:
        count = -(-len(pages) // pages_per_chunk)  # the fewest chunks; then spread the pages evenly
        begin = pages.start
        for index in range(count):
            size = len(pages) // count + (index < len(pages) % count)
            chunks.append(ChunkShape(layers.start, layers.stop, begin, begin + size))
            begin += size
        return chunks
    layers_per_chunk = max_chunk_bytes // page_bytes
    for page in pages:
        for layer in range(layers.start, layers.stop, layers_per_chunk):
            chunks.append(ChunkShape(layer, min(layer + layers_per_chunk, layers.stop), page, page + 1))
    return chunks


def split_for_streams(layers: range, pages: range, streams: int) -> list[tuple[range, range]]:
    """Cuts one send's `layers` x `pages` into at most `streams` contiguous blocks, block i for KV
    stream i: along the longer of the two dimensions, as evenly as it goes.

    Example, 4 streams: a layer-wise send of layer 3, pages [0, 10) -> (3..4 x 0..3), (3..4 x 3..6),
    (3..4 x 6..8), (3..4 x 8..10); 27 layers x pages [4, 6) -> layers 0..7, 7..14, 14..21, 21..27.
    """
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    along_pages = len(pages) >= len(layers)
    whole = pages if along_pages else layers
    count = min(streams, len(whole))
    blocks: list[tuple[range, range]] = []
    begin = whole.start
    for index in range(count):
        size = len(whole) // count + (index < len(whole) % count)
        part = range(begin, begin + size)
        blocks.append((layers, part) if along_pages else (part, pages))
        begin += size
    return blocks


class SendPlan:
    """Scheduler side of one request's send: which request-local pages may go out now, per layer.

    A page of a layer may be sent once every token in it is computed for that layer; the last,
    partial page only when the whole prompt is (`final=True`). Example, page_size=4, 10-token
    prompt: `ready(3)` -> empty, `ready(8)` -> range(0, 2), `ready(10, final=True)` -> range(2, 3).
    Layer-wise, the same prompt in one chunk: `ready_layers(10, range(0, 1), final=True)` ->
    [(range(0, 1), range(0, 3))], then layer 1, ... Pages already held by the prefix cache count
    as computed from the first call.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int = 1) -> None:
        self.num_tokens = num_tokens
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_pages = -(-num_tokens // page_size)
        self._sent = [0] * num_layers  # per layer: pages [0, sent) handed out

    def ready_layers(self, computed_tokens: int, layers: range | None = None,
                     final: bool = False) -> list[tuple[range, range]]:
        """(layers, pages) groups newly sendable once `layers` hold `computed_tokens` tokens.

        Layers at the same progress form one group, so the usual case is a single group.
        """
        if not 0 <= computed_tokens <= self.num_tokens:
            raise ValueError(f"computed_tokens={computed_tokens} outside [0, {self.num_tokens}]")
        if final and computed_tokens != self.num_tokens:
            raise ValueError(f"final with {computed_tokens} of {self.num_tokens} tokens computed")
        layers = range(self.num_layers) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= self.num_layers and layers.step == 1):
            raise ValueError(f"layers {layers} outside [0, {self.num_layers})")
        upto = self.num_pages if final else computed_tokens // self.page_size
        groups: list[tuple[range, range]] = []
        for layer in layers:
            pages = range(self._sent[layer], max(upto, self._sent[layer]))
            self._sent[layer] = pages.stop
            if not len(pages):
                continue
            if groups and groups[-1][1] == pages and groups[-1][0].stop == layer:
                groups[-1] = (range(groups[-1][0].start, layer + 1), pages)
            else:
                groups.append((range(layer, layer + 1), pages))
        return groups

    def ready(self, computed_tokens: int, final: bool = False) -> range:
        """Pages newly sendable in every layer (all layers must be at the same progress)."""
        groups = self.ready_layers(computed_tokens, final=final)
        if len(groups) > 1 or (groups and groups[0][0] != range(self.num_layers)):
            raise ValueError("layers were sent to different pages; use ready_layers")
        return groups[0][1] if groups else range(min(self._sent), min(self._sent))

    @property
    def sent_pages(self) -> int:
        """Pages handed out in every layer."""
        return min(self._sent)

    @property
    def done(self) -> bool:
        return self.sent_pages == self.num_pages
