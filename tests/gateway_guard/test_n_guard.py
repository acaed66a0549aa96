"""The gateway's n guard (deepseek_pd/gateway_guard) against an oracle, outside the gateway.

- The committed component is what its source builds (wasm-tools), for the bound in MAX_SAMPLES.
- The guard's core module, run in wasmtime through the same canonical-ABI calls the gateway makes
  (the body copied in through cabi_realloc, on-request called with the request's 13 flat values),
  refuses a body exactly when Python's own JSON parser finds a key "n" at any depth whose value is
  a number above the bound or not a plain integer, or a key "seed" whose value is a number (smg
  1.13 drops it): on random JSON documents (printed seed) holding such keys at random depths,
  spelled "n" or "\\u006e", and strings that only look like them.
The end-to-end behaviour through the real gateway is tests/e2e/test_gateway_limits_e2e.py.
"""
from __future__ import annotations

import json
import random

import pytest

from deepseek_pd.gateway_guard import COMPONENT, MAX_SAMPLES
from deepseek_pd.gateway_guard.build import build_component, core_module_text

wasmtime = pytest.importorskip("wasmtime")

CONTINUE, REJECT = 0, 1


def test_the_committed_component_is_built_from_its_source() -> None:
    assert COMPONENT.read_bytes() == build_component(), "run python -m deepseek_pd.gateway_guard.build"


class CoreGuard:
    """The guard's core module in wasmtime, called as the component model lowers on-request."""

    def __init__(self) -> None:
        self.store = wasmtime.Store()
        module = wasmtime.Module(self.store.engine, core_module_text())
        self.exports = wasmtime.Instance(self.store, module, []).exports(self.store)
        self.memory = self.exports["memory"]

    def verdict(self, body: bytes) -> tuple[int, int]:
        """(case, status) of the action on-request returns for `body`."""
        realloc = self.exports["cabi_realloc"]
        pointer = realloc(self.store, 0, 0, 1, len(body))
        self.memory.write(self.store, body, pointer)
        on_request = self.exports["smg:gateway/middleware-on-request#on-request"]
        result = on_request(self.store, 0, 0, 0, 0, 0, 0, 0, 0, pointer, len(body), 0, 0, 0)
        raw = self.memory.read(self.store, result, result + 8)
        return raw[0], int.from_bytes(raw[4:6], "little")


def oracle_refuses(body: bytes) -> bool:
    def bad(value) -> bool:
        if isinstance(value, dict):
            return any((key == "n" and isinstance(v, (int, float)) and not isinstance(v, bool)
                        and (isinstance(v, float) and v >= 0 or v > MAX_SAMPLES))
                       or (key == "seed" and isinstance(v, (int, float)) and not isinstance(v, bool))
                       or bad(v) for key, v in value.items())
        if isinstance(value, list):
            return any(bad(v) for v in value)
        return False
    return bad(json.loads(body))


def random_document(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth > 3 or pick < 0.3:
        return rng.choice([rng.randint(-5, 10**7), rng.random() * 500, "n", '"n": 999999', "\\u006e", True, None,
                           '"seed": 7'])
    if pick < 0.45:
        return [random_document(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["n", "m", "nn", "sampling_params", "text", "n ", "N", "seed", "seeds", "Seed"]
    return {rng.choice(keys): random_document(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def encode(document, rng: random.Random) -> bytes:
    """JSON text, with some keys "n" escaped as \\u006e / \\u006E and whitespace around colons."""
    text = json.dumps(document, separators=(",", rng.choice([":", ": ", " : "])))
    if rng.random() < 0.3:
        text = text.replace('"n":', rng.choice(['"\\u006e":', '"\\u006E":']))
    return text.encode()


def test_the_guard_refuses_exactly_what_a_json_parser_reads_as_a_large_n() -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    guard = CoreGuard()
    refused = 0
    for _ in range(600):
        document = random_document(rng)
        if rng.random() < 0.5:
            document = {"sampling_params": {"n": rng.choice([1, MAX_SAMPLES, MAX_SAMPLES + 1, 10**6, 2.0]),
                                            "extra": document}}
        body = encode(document, rng)
        want = oracle_refuses(body)
        refused += want
        assert guard.verdict(body) == ((REJECT, 400) if want else (CONTINUE, 0)), body
    assert 50 < refused < 550  # both verdicts were exercised


def test_large_bodies_grow_the_guard_memory() -> None:
    guard = CoreGuard()
    filler = "x" * (3 << 20)  # beyond the module's first 64 KiB page
    assert guard.verdict(json.dumps({"text": filler, "n": 3}).encode()) == (CONTINUE, 0)
    assert guard.verdict(json.dumps({"text": filler, "n": MAX_SAMPLES + 1}).encode()) == (REJECT, 400)
