"""KV over the bootstrap service's own Transfer stream, for clusters without Mooncake.

Prefill: each `send` cuts the pages into `KVChunk`s below `max_chunk_bytes` (gRPC caps a message
at 4 MiB by default), stamps a crc32 on each and hands them to `emit`, which waits for room on
the room's bounded queue: a slow decode side slows the prefill side (HTTP/2 flow control on the
stream plus the bounded queue), it never buffers a whole prompt.

Decode: the sink checks each chunk (ranges, size, crc32), writes it into the pool and records
which (layer, page) cells it has, so a missing chunk is caught at TransferDone.
"""
from __future__ import annotations

import asyncio
import zlib
from typing import Sequence

import torch

from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.common.api import FailureCode
from deepseek_pd.workers.common.kv_transfer.base import (
    EmitChunk, KVReceiver, KVSender, KVSink, SendChannel, TransferError)
from deepseek_pd.workers.common.kv_transfer.plan import split_into_chunks


def read_pages(pool: KVPool, layer_begin: int, layer_end: int, pages: Sequence[int]) -> bytes:
    """Bytes of `pages` in layers [layer_begin, layer_end), laid out [layer][page][slot][dim]."""
    index = torch.as_tensor(list(pages), dtype=torch.long, device=pool.device)
    stacked = torch.stack([pool.buffers[layer].index_select(0, index)
                           for layer in range(layer_begin, layer_end)])
    return stacked.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def write_pages(pool: KVPool, layer_begin: int, layer_end: int, pages: Sequence[int],
                data: bytes) -> None:
    """Inverse of `read_pages`: writes `data` into `pages` of layers [layer_begin, layer_end)."""
    shape = (layer_end - layer_begin, len(pages), pool.page_size, pool.kv_dim)
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(pool.dtype).view(shape)
    index = torch.as_tensor(list(pages), dtype=torch.long, device=pool.device)
    for offset, layer in enumerate(range(layer_begin, layer_end)):
        pool.buffers[layer].index_copy_(0, index, values[offset].to(pool.device))


class GrpcChannel(SendChannel):
    def __init__(self, pool: KVPool, dst_pages: Sequence[int], emit: EmitChunk,
                 max_chunk_bytes: int, timeout_s: float) -> None:
        super().__init__(pool, dst_pages)
        self.emit = emit
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s

    async def send(self, src_pages: Sequence[int], page_begin: int) -> None:
        self._check_range(src_pages, page_begin)
        page_end = page_begin + len(src_pages)
        shapes = split_into_chunks(self.pool.num_layers, page_begin, page_end,
                                   self.pool.bytes_per_page, self.max_chunk_bytes)
        for shape in shapes:
            local = src_pages[shape.page_begin - page_begin:shape.page_end - page_begin]
            data = await asyncio.to_thread(read_pages, self.pool, shape.layer_begin, shape.layer_end, local)
            chunk = pb.KVChunk(layer_begin=shape.layer_begin, layer_end=shape.layer_end,
                               page_begin=shape.page_begin, page_end=shape.page_end,
                               data=data, crc32=zlib.crc32(data))
            try:
                await asyncio.wait_for(self.emit(chunk), self.timeout_s)
            except asyncio.TimeoutError:
                raise TransferError(FailureCode.DEADLINE_EXCEEDED,
                                    f"decode side took more than {self.timeout_s}s to accept a KV chunk") from None
            self.bytes_sent += len(data)


class GrpcSender(KVSender):
    name = "grpc"

    def _open(self, handshake: pb.Handshake, emit: EmitChunk) -> SendChannel:
        limit = min(self.config.max_chunk_bytes, handshake.grpc.max_chunk_bytes or self.config.max_chunk_bytes)
        if self.pool.bytes_per_page > limit:
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"one KV page is {self.pool.bytes_per_page} bytes, above the chunk limit {limit}")
        return GrpcChannel(self.pool, handshake.page_ids, emit, limit, self.config.send_timeout_s)


class GrpcSink(KVSink):
    def __init__(self, pool: KVPool, pages: Sequence[int]) -> None:
        super().__init__(pool, pages)
        # received[layer][page]: guards against missing and duplicated chunks.
        self.received = torch.zeros(pool.num_layers, len(self.pages), dtype=torch.bool)

    def on_chunk(self, chunk: pb.KVChunk) -> None:
        if not (0 <= chunk.layer_begin < chunk.layer_end <= self.pool.num_layers
                and 0 <= chunk.page_begin < chunk.page_end <= len(self.pages)):
            raise TransferError(FailureCode.INTERNAL,
                                f"KV chunk layers [{chunk.layer_begin}, {chunk.layer_end}) pages "
                                f"[{chunk.page_begin}, {chunk.page_end}) is out of range "
                                f"({self.pool.num_layers} layers, {len(self.pages)} pages)")
        expected = ((chunk.layer_end - chunk.layer_begin) * (chunk.page_end - chunk.page_begin)
                    * self.pool.bytes_per_page)
        if len(chunk.data) != expected:
            raise TransferError(FailureCode.INTERNAL,
                                f"KV chunk has {len(chunk.data)} bytes, its ranges need {expected}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise TransferError(FailureCode.INTERNAL,
                                f"KV chunk layers [{chunk.layer_begin}, {chunk.layer_end}) pages "
                                f"[{chunk.page_begin}, {chunk.page_end}) failed its crc32 check (corrupted)")
        cells = self.received[chunk.layer_begin:chunk.layer_end, chunk.page_begin:chunk.page_end]
        if bool(cells.any()):
            raise TransferError(FailureCode.INTERNAL, "KV chunk repeats pages already received")
        write_pages(self.pool, chunk.layer_begin, chunk.layer_end,
                    self.pages[chunk.page_begin:chunk.page_end], chunk.data)
        cells.fill_(True)

    def check_complete(self, done: pb.TransferDone) -> None:
        super().check_complete(done)
        if not bool(self.received.all()):
            missing = int((~self.received).sum())
            raise TransferError(FailureCode.INTERNAL,
                                f"transfer reported done but {missing} (layer, page) cells never arrived")


class GrpcReceiver(KVReceiver):
    name = "grpc"

    def fill_destination(self, handshake: pb.Handshake) -> None:
        handshake.grpc.max_chunk_bytes = self.config.max_chunk_bytes

    def open_sink(self, pages: Sequence[int]) -> KVSink:
        return GrpcSink(self.pool, pages)
