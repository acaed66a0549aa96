"""KVPush's seal of a mooncake transfer: the MAC over every byte sent, proved as the sends went out
(`SendChannel.begin_seal`), so `finish` only digests, on the event loop: no thread hop, nor a queue
behind other transfers' threads, on the first token's path. Oracle: the one-shot MAC of the same
pages (kv_mac.kv_mac) and the documented header."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.kv_push import KVPush
from deepseek_pd.workers.prefill.room_registry import RoomRegistry
from deepseek_pd.workers.transport import TransportConfig, kv_mac
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.bootstrap_protocol import handshake_version
from deepseek_pd.workers.transport.wire import EncodedChunk
from deepseek_pd.workers.transport.mooncake import MooncakeReceiver, MooncakeSender
from deepseek_pd.workers.transport.mooncake_channel import MooncakeChannel
from pdtest import mooncake_stub
from pdtest.kv_transfer_harness import random_pool, scattered_alloc

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("direction", ["pull", "write"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_finish_seals_every_byte_sent_without_a_thread_hop(monkeypatch, layerwise, direction):
    mooncake_stub.install(monkeypatch)
    rng = random.Random()
    page_size = rng.choice([1, 2, 4])
    src = random_pool(rng, 24, page_size, num_layers=rng.randrange(1, 4))
    dst = random_pool(rng, 24, page_size, num_layers=src.num_layers)
    num_pages = rng.randrange(1, 6)
    num_tokens = num_pages * page_size - rng.randrange(page_size)
    src_pages = scattered_alloc(src, rng, num_pages)
    config = TransportConfig(advertise_host="127.0.0.1", mooncake_kv_direction=direction)
    sender, receiver = MooncakeSender(src, config), MooncakeReceiver(dst, config)
    sealed_on: list[threading.Thread] = []
    seal = MooncakeChannel.seal

    def traced(self, done, key, room):
        sealed_on.append(threading.current_thread())
        seal(self, done, key, room)
    monkeypatch.setattr(MooncakeChannel, "seal", traced)

    async def run() -> pb.TransferDone:
        registry = RoomRegistry(BootstrapConfig(port=0))
        room_id = rng.randrange(1, 1 << 30)
        push = KVPush(registry, sender, room_id, "p-req", num_tokens)
        push.room.kv_key = bytes(rng.randrange(256) for _ in range(kv_mac.KEY_BYTES))  # as the servicer sets it
        sink = receiver.open_sink(scattered_alloc(dst, rng, num_pages))
        handshake = pb.Handshake(room=room_id, num_tokens=num_tokens, page_ids=sink.pages, layout=layout_of(dst))
        receiver.fill_destination(handshake)
        handshake.protocol_version = handshake_version(handshake)
        await sink.reserve()
        sink.expose()
        sink.offer_into(handshake)
        registry.attach(handshake)
        try:
            await push.handshake(timeout_s=5)
            cuts = sorted({rng.randrange(1, num_tokens + 1) for _ in range(2)} | {num_tokens})
            for computed in cuts:  # chunks, each layer by layer or all layers at once
                for layer in range(src.num_layers) if layerwise else [None]:
                    if layer is None:
                        push.pages_ready(computed, src_pages)
                    else:
                        push.layers_ready(computed, src_pages, layer, layer + 1)
                await asyncio.sleep(0)
            finishing = asyncio.create_task(push.finish(first_token_id=7, logprob=-0.1, cached_tokens=0))
            while True:  # the bootstrap stream's part: credit each report (a pulled one's slots), confirm the done
                event = await push.room.events.get()
                if isinstance(event, EncodedChunk):
                    push.room.note_credited(event.seq)
                if isinstance(event, pb.TransferEvent) and event.HasField("done"):
                    push.room.delivered.set_result(True)
                    break
            await finishing
            return event.done, push.room.kv_key, room_id, list(handshake.page_ids)
        finally:
            push.close()
            sink.withdraw()
    done, key, room_id, told = asyncio.run(run())
    assert sealed_on == [threading.main_thread()]  # asyncio.run's loop runs on this thread
    assert done.kv_mac == kv_mac.kv_mac(src, src_pages, key, kv_mac.header(room_id, told))
