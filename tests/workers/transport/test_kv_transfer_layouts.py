"""The KV stream copies exactly across page layouts, dtypes and layer-wise send orders."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest
import torch

from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.transport.grpc_stream import GrpcSink
from deepseek_pd.workers.transport.plan import SendPlan
from pdtest.kv_transfer_harness import Exchange, layer_groups, pages_equal, random_exchange, run_exchange

pytestmark = pytest.mark.timeout(120)


def layout_exchange(transport: str, page_size: int, dtype: torch.dtype, layerwise: bool) -> Exchange:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num_layers, kv_dim = rng.randrange(2, 6), rng.choice([8, 24, 40])
    num_pages = rng.randrange(2, 7)
    # A partial last page whenever a page holds more than one token.
    num_tokens = (num_pages - 1) * page_size + (rng.randrange(1, page_size) if page_size > 1 else 1)
    exchange = random_exchange(rng, transport, num_tokens=num_tokens, page_size=page_size, num_layers=num_layers,
                               kv_dim=kv_dim, dtype=dtype, layerwise=layerwise, seed=seed)
    page_bytes = exchange.src.pool.bytes_per_page
    # From one page of one layer per chunk (layers split) to everything in one chunk.
    limit = max(1024, rng.choice([page_bytes, page_bytes * rng.randrange(2, 2 * num_layers + 2), 4 << 20]))
    return dataclasses.replace(exchange, transport_config=TransportConfig(max_chunk_bytes=limit))


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-layers", "layerwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_grpc_stream_is_exact(page_size, dtype, layerwise):
    exchange = layout_exchange("grpc", page_size, dtype, layerwise)
    before = [buffer.clone() for buffer in exchange.dst.pool.buffers]
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), prefill
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(exchange), f"seed {exchange.seed}"
    untouched = sorted(set(range(exchange.dst.pool.num_pages)) - set(exchange.dst.pages))
    for layer, buffer in enumerate(exchange.dst.pool.buffers):
        assert torch.equal(buffer[untouched], before[layer][untouched]), f"seed {exchange.seed}"


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_layerwise_sends_in_any_order_are_exact(transport):
    for _ in range(3):
        exchange = layout_exchange(transport, random.choice([1, 4, 16]), torch.float32, layerwise=True)
        prefill, decode = asyncio.run(run_exchange(exchange))
        assert not isinstance(decode, BaseException), decode
        assert pages_equal(exchange), f"seed {exchange.seed}"


def test_chunks_are_checked_and_written_off_the_event_loop(monkeypatch):
    """The decode scheduler shares the event loop: no chunk may be written on it."""
    threads: list[int] = []
    original = GrpcSink.on_chunk

    def spy(self, chunk):
        threads.append(threading.get_ident())
        return original(self, chunk)

    monkeypatch.setattr(GrpcSink, "on_chunk", spy)
    exchange = layout_exchange("grpc", 4, torch.float32, layerwise=False)
    loop_thread = threading.get_ident()  # asyncio.run runs the loop in this thread
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(decode, BaseException), decode
    assert threads and loop_thread not in threads


def test_send_plan_layer_by_layer_matches_a_cell_oracle():
    """Whatever the order of layer groups and chunks, every (layer, page) cell is handed out once,
    and only when its page is complete in that layer (or the prompt is)."""
    rng = random.Random()
    for _ in range(200):
        page_size, num_tokens, num_layers = rng.randrange(1, 6), rng.randrange(1, 40), rng.randrange(1, 6)
        plan = SendPlan(num_tokens, page_size, num_layers)
        cells: list[tuple[int, int]] = []
        computed = 0
        while computed < num_tokens:
            computed = min(num_tokens, computed + rng.randrange(1, 10))
            final = computed == num_tokens
            for layers in layer_groups(rng, num_layers):
                for group_layers, pages in plan.ready_layers(computed, layers, final):
                    assert set(group_layers) <= set(layers)
                    assert all((p + 1) * page_size <= computed or final for p in pages)
                    cells += [(layer, page) for layer in group_layers for page in pages]
        assert sorted(cells) == [(lay, p) for lay in range(num_layers) for p in range(-(-num_tokens // page_size))]
        assert len(set(cells)) == len(cells) and plan.done
