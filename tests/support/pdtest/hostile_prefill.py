"""A prefill engine of the deployment that lies to decode workers (a compromised or buggy peer:
it holds the secret, so only decode's own checks of what arrives stand between it and the
requests that share the decode batch or later reuse the pages).

`lie_about_first_token(engine)`: every TransferDone names a first token past the vocabulary.
`poison_sent_kv(engine)`: every KV send carries a NaN at a random (layer, slot, value) of its
first page. `withhold_a_layer(engine)`: every KV send leaves out its last layer (finite bytes are
written, and decode finds the transfer incomplete at the TransferDone). `poison_and_hold(engine, sent, release)`: every KV send is all NaN, and TransferDone
waits for `release` (so the NaN sits in the decode pool, unchecked, while other requests decode);
`sent` is set when a room's last chunk is out (`hold_transfer_done` alone holds without
poisoning). All patch one started engine (its registry, its
sender), never a class.
"""
from __future__ import annotations

import asyncio
import random
from typing import Awaitable, Callable

import torch

from deepseek_pd.workers.prefill.engine import PrefillEngine


def lie_about_first_token(engine: PrefillEngine, rng: random.Random) -> None:
    assert engine.registry is not None, "start() first"
    vocab = engine.runner.model_config.vocab_size
    claim = engine.registry.claim

    def claim_lying(room_id: int, rid: str):
        room = claim(room_id, rid)
        finish = room.finish

        async def finish_lying(done, timeout_s):
            done.first_token_id = vocab + rng.randrange(1 << 16)
            await finish(done, timeout_s=timeout_s)
        room.finish = finish_lying
        return room
    engine.registry.claim = claim_lying


Send = Callable[..., Awaitable[None]]  # a channel's send(src_pages, page_begin, layer_begin, layer_end, ready)


def _wrap_sends(engine: PrefillEngine, wrap: Callable[[Send], Send]) -> None:
    """Every channel the engine opens from now on sends through `wrap(its own send)`."""
    assert engine.sender is not None, "start() first"
    open_channel = engine.sender.open

    def open_wrapped(handshake, emit, streams=1):
        channel = open_channel(handshake, emit, streams)
        channel.send = wrap(channel.send)
        return channel
    engine.sender.open = open_wrapped


def poison_sent_kv(engine: PrefillEngine, rng: random.Random) -> None:
    pool = engine.pool

    def wrap(send: Send) -> Send:
        async def send_poisoned(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
            layer = rng.randrange(layer_begin, pool.num_layers if layer_end is None else layer_end)
            slot, value = rng.randrange(pool.page_size), rng.randrange(pool.kv_dim)
            pool.buffers[layer][src_pages[0], slot, value] = float("nan")
            await send(src_pages, page_begin, layer_begin, layer_end, ready)
        return send_poisoned
    _wrap_sends(engine, wrap)


def withhold_a_layer(engine: PrefillEngine) -> None:
    pool = engine.pool

    def wrap(send: Send) -> Send:
        async def send_short(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
            end = pool.num_layers if layer_end is None else layer_end
            if end == pool.num_layers:
                end -= 1  # the last layer never goes out
            if end > layer_begin:
                await send(src_pages, page_begin, layer_begin, end, ready)
        return send_short
    _wrap_sends(engine, wrap)


def poison_and_hold(engine: PrefillEngine, sent: asyncio.Event, release: asyncio.Event) -> None:
    pool = engine.pool

    def wrap(send: Send) -> Send:
        async def send_all_nan(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
            index = torch.tensor(list(src_pages), dtype=torch.long, device=pool.device)
            for layer in range(layer_begin, pool.num_layers if layer_end is None else layer_end):
                pool.buffers[layer].index_fill_(0, index, float("nan"))
            await send(src_pages, page_begin, layer_begin, layer_end, ready)
        return send_all_nan
    _wrap_sends(engine, wrap)
    hold_transfer_done(engine, sent, release)


def hold_transfer_done(engine: PrefillEngine, sent: asyncio.Event, release: asyncio.Event):
    """Every room's TransferDone waits for `release` (its transfer stays in flight on the decode
    side); `sent` is set when one is ready. Returns the undo (the registry's own `claim` back)."""
    assert engine.registry is not None, "start() first"
    claim = engine.registry.claim

    def claim_holding(room_id: int, rid: str):
        room = claim(room_id, rid)
        finish = room.finish

        async def finish_later(done, timeout_s):
            sent.set()
            await release.wait()
            await finish(done, timeout_s=timeout_s)
        room.finish = finish_later
        return room
    engine.registry.claim = claim_holding
    return lambda: setattr(engine.registry, "claim", claim)


LIES = {"first_token": lie_about_first_token, "nan_kv": poison_sent_kv}
