"""What the decode side checks about a finished transfer before a request may use its pages.

The transport already checked each chunk's ranges, byte count and crc32 and that every (layer,
page) cell arrived (grpc), or that the prefill side wrote only the room's own pages (mooncake);
the layouts were compared at the handshake. What remains is the content:

- `first_token_id` must be a token of the vocabulary: an id beyond it would index past the
  sampler's tables inside the batched decode step and fail every request in the batch;
- the first token's top logprobs (`first_token_wire.py`) must be what the request asked for:
  `min(k, vocabulary)` ids in the vocabulary with finite logprobs (an older prefill worker sends
  none: failing is better than streaming positions that do not line up);
- the prompt's KV must be finite: a NaN in a page poisons the request's own attention. Received
  pages are live only for their own request, and only once this check passed: a decode batch
  reads no page but its rows' own (padding repeats a row's own page, `ForwardBatch.build`), and
  every attention backend masks by selecting, so unchecked KV and stale values past a row's
  length cannot reach another request (tests/model/attention/test_attention_isolation.py,
  tests/workers/test_security_nan_peer*.py).

A request whose transfer fails any check fails alone (INTERNAL, with the reason), and its pages
are zeroed (`scrub_pages`) before they go back to the pool, so nothing it received can reach another
request. The finite check is one pass over the prompt's pages per layer on the pool's device: on
the CPU two integer reductions over the bit patterns (finite_bits.py); on the GPU `aminmax` on this
thread's side stream (page_io.side_stream) with a single sync of that stream at the end: on the
default stream its index upload and its sync waited behind the decode step in flight (py-spy:
a quarter of the decode worker's samples at 64 concurrent requests on the H200). The pages were
written and synced by the transport before, and decode reads them only after this check.

A sink that lands the KV part by part runs it on each part as it lands (`FiniteOnLanding`,
`KVSink.check_on_landing`), off the first token's path: mooncake on each send copied out of its
staging, its refusal reported after the MAC's verdict (kv_pull.py); grpc on each chunk's bytes
before they are written (so a NaN sent over the byte stream never reaches a page), or on the pages
a same-host peer wrote directly, refusing the transfer at once.
"""
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.page_io import consecutive_runs, page_index, side_stream
from deepseek_pd.workers.decode import finite_bits


def check_first_token(done: pb.TransferDone, vocab_size: int, rid: str) -> None:
    if not 0 <= done.first_token_id < vocab_size:
        raise TransferError(FailureCode.INTERNAL, f"{rid}: the prefill side's first token {done.first_token_id} "
                            f"is outside the vocabulary ({vocab_size} tokens); KV transfer refused")


def check_first_top(done: pb.TransferDone, vocab_size: int, top_logprobs_num: int, rid: str) -> None:
    want = min(top_logprobs_num, vocab_size)
    ids, values = done.first_top_token_ids, done.first_top_logprobs
    if len(ids) != want or len(values) != want:
        raise TransferError(FailureCode.INTERNAL, f"{rid}: the prefill side sent {len(ids)} top logprobs "
                            f"({len(values)} values) for the first token, the request asked for {want} "
                            f"(a prefill worker without top logprobs?); KV transfer refused")
    if any(t >= vocab_size for t in ids) or not all(math.isfinite(v) for v in values):
        raise TransferError(FailureCode.INTERNAL, f"{rid}: the prefill side's first-token top logprobs hold "
                            f"a token outside the vocabulary or a non-finite value; KV transfer refused")


@torch.no_grad()
def check_kv_finite(pool: KVPool, pages: Sequence[int], rid: str, layers: range | None = None) -> None:
    """Raises TransferError if any value of the received pages (in `layers`, default all) is NaN or
    infinite. Whole pages are
    checked, the slots past the prompt too: a NaN there would poison whoever reuses the page, and
    a legitimate prefill pool holds only finite values (zeros or earlier KV) in them.

    A CPU pool is scanned by bit patterns (`finite_bits.py`: two integer max reductions per run of
    pages in numpy, single-threaded). Otherwise each layer's pages are reduced to their minimum
    and maximum (`aminmax`, which propagates NaN, so both are finite exactly when every value is):
    one read of the KV and no per-element temporary; `isfinite(...).all()` wrote a bool per value
    first and was 6x slower.
    """
    if not pages:
        return
    layers = range(pool.num_layers) if layers is None else layers
    if pool.device.type == "cpu" and finite_bits.supports(pool.dtype):
        _refuse_layers(finite_bits.nonfinite_layers(pool, pages, layers), rid)
        return
    with _on_side_stream(pool):
        extremes = torch.stack([torch.stack(torch.aminmax(part)).float()
                                for part in _page_parts(pool, pages, layers)])
        # The one sync, of this stream only. Pageable on purpose: two floats a layer, read at once;
        # `HostCopy` would take page-locked memory in this (transport) thread, which can wait for
        # the whole device (model/host_copy_staging.py), and with every upload page-locked no
        # copy holds the driver's shared staging behind a queued forward.
        extremes = extremes.to("cpu")
    per_layer = torch.isfinite(extremes).view(len(layers), -1).all(dim=1)
    _refuse_layers([layers[i] for i in torch.nonzero(~per_layer).flatten().tolist()], rid)


def check_data_finite(data: memoryview, dtype: torch.dtype, layers: range, rid: str) -> None:
    """Raises TransferError if a chunk's bytes (`[layer][page][slot][dim]` values of `dtype` for
    `layers`, in host memory: a gRPC message) hold a NaN or an infinity; read where they lie, in
    the caller's thread (numpy releases the GIL)."""
    if finite_bits.supports(dtype):
        bad = finite_bits.nonfinite_rows(data, dtype, len(layers))
    else:  # (a float format whose non-finite patterns are not one range, e.g. the "fnuz" float8s)
        values = torch.frombuffer(bytearray(data), dtype=dtype).view(len(layers), -1).float()
        bad = torch.nonzero(~torch.isfinite(values).all(dim=1)).flatten().tolist()
    _refuse_layers([layers[row] for row in bad], rid)


class FiniteOnLanding:
    """The finite check as a sink runs it on each part of one transfer as it lands (a
    `transport.base.LandingCheck`): on a chunk's bytes before they are written, or on the pool's
    pages once they hold what landed."""

    def __init__(self, pool: KVPool, rid: str) -> None:
        self.pool, self.rid = pool, rid

    def data(self, layers: range, data: memoryview) -> None:
        check_data_finite(data, self.pool.dtype, layers, self.rid)

    def pages(self, layers: range, pages: list[int]) -> None:
        check_kv_finite(self.pool, pages, self.rid, layers)


def _refuse_layers(bad: list[int], rid: str) -> None:
    if bad:
        raise TransferError(FailureCode.INTERNAL, f"{rid}: the received KV holds NaN or infinite values "
                            f"(layers {bad[:8]}); KV transfer refused")


def _page_parts(pool: KVPool, pages: Sequence[int], layers: range) -> list[torch.Tensor]:
    """`pages` of `layers`, layer-major, as tensors that cover them: on the GPU one gathered
    tensor per layer; on the CPU views of each run of consecutive pages (no copy), the same runs
    in every layer, so that the caller can regroup the parts by layer."""
    if pool.device.type == "cuda":
        index = page_index(pool, pages)
        return [pool.buffers[layer].index_select(0, index) for layer in layers]
    runs = consecutive_runs(pages)
    return [pool.buffers[layer][first:first + end - begin] for layer in layers for begin, end, first in runs]


def _on_side_stream(pool: KVPool):
    if pool.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(side_stream(pool.device))


@torch.no_grad()
def scrub_pages(pool: KVPool, pages: Sequence[int]) -> None:
    """Zeroes `pages` in every layer: a refused or partial transfer leaves nothing behind.

    Returns once the zeros are in memory (on CUDA it syncs its side stream): the caller frees the
    pages next, and their next owner's KV may arrive by a NIC or on another stream, which a zeroing
    still queued on the GPU could otherwise overwrite. It blocks, so the engine runs it in a worker
    thread (DecodeEngine._release, PageBudget.release), never on the event loop."""
    if not pages:
        return
    with _on_side_stream(pool):
        index = page_index(pool, pages)
        for buffer in pool.buffers:
            buffer.index_fill_(0, index, 0)
    if pool.device.type == "cuda":
        side_stream(pool.device).synchronize()
