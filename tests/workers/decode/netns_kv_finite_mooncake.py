"""The decode side's finite check over real Mooncake TCP writes, run by test_kv_finite_mooncake.py
inside a private network namespace.

bfloat16 pools (the model's KV dtype, so the CPU bit-pattern scan runs): a clean transfer, with
the format's extreme finite values sprinkled in, arrives bit-exact and is taken; one NaN or
infinity put in the prefill pool, in the request's first layer and first page, in its last layer
and last page (past the prompt's end when the last page is partial), and at a random place, is
written by Mooncake and refused by the decode side, naming its layer. Exits non-zero with the
assertion on failure; prints one line per case.
"""
from __future__ import annotations

import asyncio
import random
import sys

import torch

from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from pdtest.kv_transfer_harness import Exchange, pages_equal, random_exchange, run_exchange

BF16_NON_FINITE = [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF]  # +-inf, +-NaN, NaN payloads


def exchange_for(rng: random.Random, layerwise: bool) -> Exchange:
    page_size = rng.choice([1, 4, 16])
    num_tokens = rng.randrange(2, 80)
    return random_exchange(rng, "mooncake", num_tokens=num_tokens, page_size=page_size, num_layers=rng.randrange(2, 6),
                           kv_dim=rng.choice([8, 64]), dtype=torch.bfloat16, chunks=3, layerwise=layerwise,
                           seed=rng.randrange(1 << 30))


def put_bits(exchange: Exchange, layer: int, page: int, rng: random.Random, bits: int) -> None:
    """Sets one value of request-local `page` in `layer` of the prefill pool to the bf16 `bits`."""
    buffer = exchange.src.pool.buffers[layer][exchange.src.pages[page]].view(-1)
    buffer.view(torch.int16)[rng.randrange(buffer.numel())] = bits - (1 << 16) if bits >= 1 << 15 else bits


def check_clean(rng: random.Random) -> None:
    exchange = exchange_for(rng, layerwise=False)
    big = 0x7F7F  # bf16 finfo.max; with the sign bit: -max. -0.0 and the smallest subnormals too.
    for bits in [big, big | 0x8000, 0x8000, 0x0001, 0x8001]:
        put_bits(exchange, rng.randrange(exchange.src.pool.num_layers), rng.randrange(len(exchange.src.pages)),
                 rng, bits)
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), repr(prefill)
    assert not isinstance(decode, BaseException), repr(decode)
    assert pages_equal(exchange), "clean transfer: pages differ"
    print(f"clean ok: {len(exchange.dst.pages)} pages x {exchange.src.pool.num_layers} layers, bit-exact")


def check_refused(rng: random.Random, where: str) -> None:
    exchange = exchange_for(rng, layerwise=where == "random")
    layers, pages = exchange.src.pool.num_layers, len(exchange.src.pages)
    layer, page = {"first": (0, 0), "last": (layers - 1, pages - 1),
                   "random": (rng.randrange(layers), rng.randrange(pages))}[where]
    bits = rng.choice(BF16_NON_FINITE)
    put_bits(exchange, layer, page, rng, bits)
    prefill, decode = asyncio.run(run_exchange(exchange))
    assert not isinstance(prefill, BaseException), repr(prefill)  # the writes themselves went through
    assert isinstance(decode, TransferError), f"{where}: {bits:#x} in layer {layer} page {page} taken: {decode!r}"
    assert decode.code == FailureCode.INTERNAL and f"(layers [{layer}])" in decode.message, decode.message
    print(f"refused ok: {where} layer {layer}/{layers} page {page}/{pages} bits {bits:#x}")


if __name__ == "__main__":
    rng = random.Random(int(sys.argv[1]))
    check_clean(rng)
    for where in ("first", "last", "random"):
        check_refused(rng, where)
