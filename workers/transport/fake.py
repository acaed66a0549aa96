"""In-process transport for unit tests: the prefill side copies straight into the decode pool.

The decode pool is published under a random key in a process-wide table (weakly held), and the
handshake carries the key. Only meaningful when both sides share one process.
"""
from __future__ import annotations

import asyncio
import uuid
import weakref
from typing import Sequence

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.base import (
    EmitChunk, KVReceiver, KVSender, SendChannel, TransportConfig)
from deepseek_pd.workers.transport.page_io import sync_ready
from deepseek_pd.workers.transport.plan import merge_page_runs
from deepseek_pd.workers.engine.request_failure import TransferError

_POOLS: "weakref.WeakValueDictionary[str, KVPool]" = weakref.WeakValueDictionary()


class FakeReceiver(KVReceiver):
    name = "fake"

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        super().__init__(pool, config)
        self.key = uuid.uuid4().hex
        _POOLS[self.key] = pool

    def fill_destination(self, handshake: pb.Handshake) -> None:
        handshake.fake.pool_key = self.key

    def close(self) -> None:
        _POOLS.pop(self.key, None)


class FakeChannel(SendChannel):
    def __init__(self, pool: KVPool, dst_pages: Sequence[int], dst_pool: KVPool,
                 timeout_s: float) -> None:
        super().__init__(pool, dst_pages)
        self.dst_pool = dst_pool
        self.timeout_s = timeout_s

    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready=None) -> None:
        layers = self._check_range(src_pages, page_begin, layer_begin, layer_end)
        dst = self.dst_pages[page_begin:page_begin + len(src_pages)]
        await asyncio.wait_for(asyncio.to_thread(self._copy, list(src_pages), dst, layers, ready), self.timeout_s)
        self.bytes_sent += len(src_pages) * self.pool.bytes_per_page * len(layers)

    def _copy(self, src_pages: list[int], dst_pages: list[int], layers: range, ready) -> None:
        sync_ready(self.pool, ready)
        for run in merge_page_runs(src_pages, dst_pages):
            for layer in layers:
                src = self.pool.buffers[layer][run.src:run.src + run.length]
                self.dst_pool.buffers[layer][run.dst:run.dst + run.length].copy_(src)


class FakeSender(KVSender):
    name = "fake"

    def _open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int) -> SendChannel:
        dst_pool = _POOLS.get(handshake.fake.pool_key)
        if dst_pool is None:
            raise TransferError(FailureCode.UNAVAILABLE,
                                f"fake transport: no decode pool {handshake.fake.pool_key!r} in this process")
        return FakeChannel(self.pool, handshake.page_ids, dst_pool, self.config.send_timeout_s)

