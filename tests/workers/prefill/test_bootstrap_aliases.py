"""A prefill bootstrap service answers to the names in BootstrapConfig.aliases (`serve
--bootstrap-alias`, the pod DNS name the operator renders) and to no other: decode signs its
handshake for the host it dials, so a name the service does not know is refused."""
from __future__ import annotations

import asyncio
import dataclasses
import random

from deepseek_pd.workers.transport import TransportConfig
from deepseek_pd.workers.engine.request_failure import RequestFailure
from pdtest.kv_transfer_harness import Exchange, pages_equal, random_exchange, run_exchange


def _exchange(rng: random.Random, aliases: tuple[str, ...]) -> Exchange:
    num_tokens, page_size = rng.randrange(4, 40), rng.choice([1, 4])
    ex = random_exchange(rng, num_tokens=num_tokens, page_size=page_size, chunks=1, transport_config=TransportConfig(),
                         seed=rng.randrange(1 << 30))
    return dataclasses.replace(ex, bootstrap_config=dataclasses.replace(
        ex.bootstrap_config, host="127.0.0.1", aliases=aliases, handshake_timeout_s=5))


def test_decode_dialling_an_alias_is_accepted_and_an_unknown_name_refused():
    rng = random.Random()
    prefill, decode = asyncio.run(run_exchange(_exchange(rng, ()), dial_host="localhost"))
    assert isinstance(decode, RequestFailure), decode
    assert "authentication" in decode.message or "addressed" in decode.message, decode.message

    ex = _exchange(rng, ("localhost",))
    prefill, decode = asyncio.run(run_exchange(ex, dial_host="localhost"))
    assert not isinstance(prefill, BaseException), prefill
    assert not isinstance(decode, BaseException), decode
    assert pages_equal(ex)
