"""A decode pool is offered for direct writes only to a writer that may share its host
(kv_transfer/local_peer.py): an offer to another host could never be taken, yet would make every
failed transfer one-sided (its pages held for the late-write grace)."""
from __future__ import annotations

import asyncio
import random
import socket

import pytest

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.transport import TransportConfig, grpc_stream
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.transport.grpc_stream import DirectChannel, GrpcReceiver
from deepseek_pd.workers.transport.local_peer import shares_host
from pdtest.kv_transfer_harness import random_pool
from pdtest.pd_engine_harness import PDPair, oracle, worker_config

DIRECT = TransportConfig(same_host_direct="on")
# Documentation ranges (RFC 5737 / 3849): never an address of this machine.
FOREIGN = ("192.0.2.1", "198.51.100.23", "203.0.113.7", "2001:db8::5")


def _own_address() -> str | None:
    """This namespace's outgoing IPv4 address, if it has a route (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def test_loopback_and_own_addresses_share_the_host_others_do_not() -> None:
    for host in ("127.0.0.1", f"127.{random.randrange(256)}.{random.randrange(256)}.1", "::1", "localhost"):
        assert shares_host(host), host
    for host in FOREIGN + ("", "0.0.0.0", "no-such-host.invalid"):
        assert not shares_host(host), host
    own = _own_address()
    if own is not None:
        assert shares_host(own)


def test_a_name_from_a_request_is_never_looked_up(monkeypatch) -> None:
    """The host comes with each request: resolving a made-up name would block the decode worker's
    event loop (a DNS timeout) for every other request."""
    def no_dns(*args, **kwargs):
        raise AssertionError("shares_host resolved a name")
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(socket, "gethostbyname", no_dns)
    name = f"prefill-{random.randrange(1 << 30)}.example.invalid"
    assert not shares_host(name) and shares_host("LOCALHOST")


@pytest.mark.parametrize("peer", ["local", "foreign", "unknown"])
def test_the_offer_and_the_one_sided_exposure_follow_the_peer(peer) -> None:
    rng = random.Random()
    pool = random_pool(rng, 8, 2, num_layers=2)
    receiver = GrpcReceiver(pool, DIRECT)
    try:
        host = {"local": "127.0.0.1", "foreign": rng.choice(FOREIGN), "unknown": None}[peer]
        sink = receiver.open_sink([0, 1], host)
        handshake = pb.Handshake(room=1, page_ids=[0, 1], layout=layout_of(pool))
        receiver.fill_destination(handshake)
        sink.offer_into(handshake)
        offered = peer != "foreign"  # an unknown peer keeps the offer: the conservative side
        assert handshake.grpc.HasField("direct") == offered == sink.offered_direct
        sink.exposure.handed_out()
        # A failed transfer's pages wait out the grace only when the writer was offered the pool.
        assert sink.exposure.late_writes == offered and sink.exposure.may_be_written == offered
    finally:
        receiver.close()


def test_a_pd_request_to_a_foreign_prefill_address_streams_its_bytes(monkeypatch) -> None:
    """The engine hands the request's bootstrap host to the sink: with that host not this machine's
    (patched), the prefill is offered nothing and sends bytes; the tokens stay the oracle's."""
    rng = random.Random()
    asked: list[str] = []
    monkeypatch.setattr(grpc_stream, "shares_host", lambda host: asked.append(host) or False)
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randint(5, 40))]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)

    async def run():
        cfg = worker_config("grpc", same_host_direct="on")
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            channels = []
            open_channel = pair.prefill.sender.open

            def traced(handshake, emit, streams=1):
                channels.append(open_channel(handshake, emit, streams))
                return channels[-1]
            pair.prefill.sender.open = traced
            _, decode = await pair.run(prompt, params, "foreign")
            await pair.wait_pools_clean()
            return channels, decode.tokens

    channels, tokens = asyncio.run(run())
    assert tokens == oracle().generate(prompt, params).output_ids
    assert asked == ["127.0.0.1"] and channels and not any(isinstance(c, DirectChannel) for c in channels)
