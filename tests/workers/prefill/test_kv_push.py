"""KVPush on its own: a room that has failed gets no more writes into the decode pool.

A one-sided channel (same-host direct copies here, on CPU pools of one process) writes a send's
pages into the decode pool before it queues the chunk that says so; once the decode side is gone
(or the room failed), those pages are no longer the transfer's, so a send queued after that must
not write them. The oracle is the decode pool itself: the page sent before the failure holds the
prefill bytes, the page queued after it is untouched.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.grpc_stream import DirectChannel, GrpcReceiver, GrpcSender
from deepseek_pd.workers.engine.request_failure import RequestFailure
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.kv_push import KVPush
from deepseek_pd.workers.prefill.room_registry import RoomRegistry
from pdtest.kv_transfer_harness import random_pool, scattered_alloc

pytestmark = pytest.mark.timeout(60)
DIRECT = TransportConfig(same_host_direct="on")


@pytest.mark.parametrize("how", ["decode gone", "room failed"])
def test_no_direct_write_after_the_room_failed(how):
    rng = random.Random()
    page_size = rng.choice([1, 2, 4])
    src = random_pool(rng, 12, page_size, num_layers=rng.randrange(1, 4))
    dst = random_pool(rng, 12, page_size, num_layers=src.num_layers)
    src_pages, dst_pages = scattered_alloc(src, rng, 2), scattered_alloc(dst, rng, 2)
    num_tokens = 2 * page_size
    sender, receiver = GrpcSender(src, DIRECT), GrpcReceiver(dst, DIRECT)

    async def run() -> None:
        registry = RoomRegistry(BootstrapConfig(port=0))
        room_id = rng.randrange(1, 1 << 30)
        push = KVPush(registry, sender, room_id, "p-req", num_tokens)
        handshake = pb.Handshake(room=room_id, num_tokens=num_tokens, page_ids=dst_pages, layout=layout_of(dst))
        receiver.fill_destination(handshake)
        receiver.open_sink(dst_pages, "127.0.0.1").offer_into(handshake)  # a same-host decode's offer
        registry.attach(handshake)
        try:
            await push.handshake(timeout_s=5)
            assert isinstance(push.channel, DirectChannel)
            push.pages_ready(page_size, src_pages)  # page 0: written, its chunk queued
            while push.room.events.empty():
                await asyncio.sleep(0.01)
            if how == "decode gone":
                push.room.mark_peer_gone(FailureCode.ABORTED, "decode gave up")
            else:
                push.fail(FailureCode.INTERNAL, "the forward failed")
            push.pages_ready(num_tokens, src_pages)  # page 1: the room is over, nothing may land
            if how == "decode gone":
                with pytest.raises(RequestFailure):
                    await push.finish(first_token_id=1, logprob=0.0, cached_tokens=0)
            else:
                push._put(None)
                await push._task
        finally:
            push.close()

    untouched = [buffer[dst_pages[1]].clone() for buffer in dst.buffers]
    try:
        asyncio.run(run())
    finally:
        sender.close()
        receiver.close()
    for layer in range(src.num_layers):
        assert torch.equal(dst.buffers[layer][dst_pages[0]], src.buffers[layer][src_pages[0]]), layer
        assert torch.equal(dst.buffers[layer][dst_pages[1]], untouched[layer]), f"layer {layer} written after {how}"
