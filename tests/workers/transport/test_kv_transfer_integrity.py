"""A damaged KV stream is refused with a clear TransferError, and the destination is marked failed.

Each case tampers with one chunk on its way into the room's stream (after the sender encoded it,
so only the decode side's checks can catch it) and keeps the stream's sequence numbers intact,
so the check under test is the one that fires, not the lost-event check.
"""
from __future__ import annotations

import asyncio
import random
import zlib

import pytest

from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.wire import ChunkHeader, EncodedChunk, decode_event, encode_chunk_event
from pdtest.kv_transfer_harness import Exchange, random_exchange, run_exchange, server_stopped_after, slowed

pytestmark = pytest.mark.timeout(60)


def many_chunk_exchange() -> Exchange:
    """A transfer of >= 6 chunks: one page of one layer (4 x 64 fp32 = 1 KiB) per chunk."""
    rng = random.Random()
    page_size = 4
    num_tokens = rng.randrange(3, 7) * page_size - rng.randrange(page_size)
    return random_exchange(rng, num_tokens=num_tokens, page_size=page_size, num_layers=rng.randrange(2, 5), kv_dim=64,
                           chunks=1, transport_config=TransportConfig(max_chunk_bytes=1024))


def reencoded(chunk: EncodedChunk, seq: int, header: ChunkHeader | None = None, data=None,
              crc: int | None = None) -> EncodedChunk:
    view = decode_event(chunk.payload).chunk
    header = header or ChunkHeader(view.layer_begin, view.layer_end, view.page_begin, view.page_end)
    data = bytes(view.data) if data is None else data
    return encode_chunk_event(seq, header, data, zlib.crc32(data) if crc is None else crc)


def tamper(kind: str, target: int):
    """An emit hook that damages chunk number `target` (0-based) the way `kind` says."""
    state = {"index": 0, "shift": 0}

    def hook(emit):
        async def wrapped(chunk: EncodedChunk):
            index = state["index"]
            state["index"] += 1
            seq = chunk.seq + state["shift"]
            if index != target:
                await emit(reencoded(chunk, seq) if state["shift"] else chunk)
                return
            view = decode_event(chunk.payload).chunk
            if kind == "flipped byte":
                data = bytearray(view.data)
                data[random.randrange(len(data))] ^= 1 << random.randrange(8)
                await emit(reencoded(chunk, seq, data=bytes(data), crc=view.crc32))
            elif kind == "short":
                await emit(reencoded(chunk, seq, data=bytes(view.data)[:-random.randrange(1, 9)]))
            elif kind == "missing":
                state["shift"] -= 1
            elif kind == "duplicated":
                await emit(chunk)
                state["shift"] += 1
                await emit(reencoded(chunk, seq + 1))
            elif kind == "out of range":
                header = ChunkHeader(view.layer_begin, view.layer_end, view.page_begin, view.page_end + 1000)
                await emit(reencoded(chunk, seq, header=header))
        return wrapped
    return hook


@pytest.mark.parametrize("kind, reason", [
    ("flipped byte", "crc32"),
    ("short", "its ranges need"),
    ("missing", "never arrived"),
    ("duplicated", "repeats pages"),
    ("out of range", "out of range"),
])
def test_damaged_stream_is_refused_and_the_destination_marked_failed(kind, reason):
    exchange = many_chunk_exchange()
    sinks: list = []
    target = random.randrange(0, 4)
    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=tamper(kind, target), sinks=sinks))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.INTERNAL, decode
    assert reason in decode.message, decode.message
    assert isinstance(prefill, TransferError), prefill  # the refusal reaches the prefill side
    assert sinks[0].failed is not None and reason in sinks[0].failed.message  # no silent partial KV


def test_stream_cut_mid_transfer_fails_decode_and_marks_the_destination_failed():
    exchange = many_chunk_exchange()
    sinks: list = []

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=slowed(0.05), decode_hook=server_stopped_after(0.15),
                                               sinks=sinks))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.UNAVAILABLE, decode
    assert isinstance(prefill, TransferError), prefill
    assert sinks[0].failed is not None
    assert not bool(sinks[0].received.all())  # it was cut short: some cells never came


def test_chunks_emitted_out_of_order_fail_the_room():
    """The stream numbers events itself; a sender that skips one is a bug and must not pass."""
    exchange = many_chunk_exchange()

    def skip(emit):
        async def wrapped(chunk):
            if chunk.seq != 2:
                await emit(chunk)
        return wrapped

    prefill, decode = asyncio.run(run_exchange(exchange, emit_hook=skip))
    assert isinstance(decode, TransferError) and decode.code == FailureCode.INTERNAL, decode
    assert "emitted as event" in decode.message
