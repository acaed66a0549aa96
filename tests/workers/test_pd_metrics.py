"""Inter-token latency and refused handshakes, scraped from /metrics after real PD traffic.

The PD engines of pdtest.pd_engine_harness (tiny model, CPU, grpc transport) serve random PD
requests and one colocated request; each engine's own `WorkerMetrics` is exported by a real
`MetricsServer`. A hostile or confused peer then provokes a random number of each kind of
handshake refusal on the prefill bootstrap port (unsigned, another DP rank's, another protocol, a
KV stream of no room, a second handshake, a room nobody claims).

Oracles: the tokens each request streamed (every token after a request's first has one gap), the
wall time of each request as the test saw it (a request's gaps add up to less), the decode steps'
own time (every step lies inside some request's gap), and the count of each refusal provoked.
"""
from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.proto import bootstrap_pb2_grpc as pb_grpc
from deepseek_pd.workers.engine.interface import GenerateRequest
from deepseek_pd.workers.transport.bootstrap_protocol import PROTOCOL_VERSION, target
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.metrics.worker_metrics import HANDSHAKE_FAILURE_REASONS
from deepseek_pd.workers.metrics.server import MetricsConfig, MetricsServer
from pdtest.pd_engine_harness import PDPair, collect, worker_config

pytestmark = pytest.mark.timeout(180)
P = "deepseek_pd:"
CLAIM_TIMEOUT_S = 1.0  # how long an unclaimed room's handshake waits before it fails ("timeout")


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k not in ("role", "model_name", "rank"))
            samples[(sample.name, labels)] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((P + name, frozenset(labels.items())), 0.0)


class _Intruder:
    """Raw bootstrap calls to one prefill worker, signed with its secret or not at all."""

    def __init__(self, pair: PDPair, rng: random.Random) -> None:
        self.auth = pair.prefill.config.bootstrap.auth
        self.address = target("127.0.0.1", pair.prefill.bootstrap_port)
        self.layout = layout_of(pair.prefill.pool)
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = pb_grpc.BootstrapStub(self.channel)
        self.rng = rng

    def room(self) -> int:
        return self.rng.randrange(10_000, 2**31)  # PDPair's own rooms count up from 1000

    def handshake(self, room: int, signed: bool = True, **fields) -> pb.DecodeMessage:
        handshake = pb.Handshake(**{"protocol_version": PROTOCOL_VERSION, "room": room, "num_tokens": 4,
                                    "page_ids": [0], "layout": self.layout, **fields})
        handshake.grpc.max_chunk_bytes = 1 << 20
        if signed:
            self.auth.sign(handshake, "handshake", "decode@intruder", self.address)
        return pb.DecodeMessage(handshake=handshake)

    async def refused(self, message: pb.DecodeMessage) -> grpc.StatusCode:
        """Sends one handshake; the code of the status the call ends with."""
        call = self.stub.Transfer()
        await call.write(message)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        return ended.value.code()

    async def unclaimed(self, room: int) -> None:
        """A valid handshake for a room no prefill request claims: acked, then failed after the timeout."""
        call = self.stub.Transfer()
        await call.write(self.handshake(room))
        assert (await call.read()).WhichOneof("event") == "accepted"
        assert (await call.read()).WhichOneof("event") == "failed"
        await call.done_writing()

    async def duplicate(self) -> None:
        """Two handshakes for one room: the second is refused; the first then times out unclaimed."""
        room = self.room()
        call = self.stub.Transfer()
        await call.write(self.handshake(room))
        assert (await call.read()).WhichOneof("event") == "accepted"
        assert await self.refused(self.handshake(room)) == grpc.StatusCode.ALREADY_EXISTS
        assert (await call.read()).WhichOneof("event") == "failed"
        await call.done_writing()

    async def stream_of_no_room(self) -> grpc.StatusCode:
        room = self.room()
        opening = pb.KVStreamOpen(room=room, index=1)
        self.auth.sign(opening, "kvstream", "decode@intruder", self.address, f"room={room};index=1")
        call = self.stub.KVStream()
        await call.write(pb.KVStreamMessage(open=opening))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call.read()
        return ended.value.code()

    async def provoke(self, reason: str) -> None:
        if reason == "unauthenticated":
            assert await self.refused(self.handshake(self.room(), signed=False)) == grpc.StatusCode.UNAUTHENTICATED
        elif reason == "wrong_dp_rank":  # decode believes the group has 2 DP ranks and this is rank 1
            code = await self.refused(self.handshake(self.room(), prefill_dp_rank=1, prefill_dp_size=2))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        elif reason == "protocol":
            code = await self.refused(self.handshake(self.room(), protocol_version=PROTOCOL_VERSION + 1))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        elif reason == "unknown_room":
            assert await self.stream_of_no_room() == grpc.StatusCode.FAILED_PRECONDITION
        elif reason == "duplicate":
            await self.duplicate()
        else:
            assert reason == "timeout"
            await self.unclaimed(self.room())


def test_inter_token_latency_and_refused_handshakes_after_pd_traffic() -> None:
    rng = random.Random()
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 40))] for _ in range(rng.randint(3, 6))]
    max_new = [rng.randint(1, 8) for _ in prompts]
    colocated_prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))]
    colocated_new = rng.randint(1, 8)
    provoked = {reason: rng.randint(0, 2) for reason in HANDSHAKE_FAILURE_REASONS}
    provoked[rng.choice(["unauthenticated", "wrong_dp_rank"])] += 1  # never none at all

    async def run():
        config = worker_config("grpc", claim_timeout_s=CLAIM_TIMEOUT_S)
        async with PDPair("grpc", prefill_config=config) as pair:
            exporters = [MetricsServer(engine.metrics, MetricsConfig("127.0.0.1", 0))
                         for engine in (pair.prefill, pair.decode)]
            prefill_port, decode_port = [await exporter.start() for exporter in exporters]
            try:
                async def timed(i: int):
                    began = time.perf_counter()
                    params = SamplingParams(max_new_tokens=max_new[i], ignore_eos=True, temperature=0.0)
                    _, decoded = await pair.run(prompts[i], params, f"r{i}")
                    return decoded, time.perf_counter() - began

                async def colocated():
                    began = time.perf_counter()
                    request = GenerateRequest(rid="colocated", input_ids=tuple(colocated_prompt),
                                              sampling=SamplingParams(max_new_tokens=colocated_new, ignore_eos=True))
                    return await collect(pair.decode, request), time.perf_counter() - began

                outcomes = await asyncio.gather(*(timed(i) for i in range(len(prompts))), colocated())
                intruder = _Intruder(pair, rng)
                try:
                    await asyncio.gather(*(intruder.provoke(reason)
                                           for reason, count in provoked.items() for _ in range(count)))
                finally:
                    await intruder.channel.close()
                await pair.wait_pools_clean()
                # The exporters answer on this loop: read them from another thread.
                return outcomes, await asyncio.to_thread(scrape, prefill_port), await asyncio.to_thread(scrape, decode_port)
            finally:
                for exporter in exporters:
                    await exporter.stop()

    outcomes, p, d = asyncio.run(run())
    assert all(outcome.ok for outcome, _ in outcomes), [outcome.terminal for outcome, _ in outcomes]
    assert [len(o.tokens) for o, _ in outcomes] == max_new + [colocated_new]

    # Decode: every streamed token after a request's first has one gap (the first decode token's
    # gap starts at the token the prefill worker sent).
    gaps = sum(len(outcome.tokens) - 1 for outcome, _ in outcomes)
    itl_sum = value(d, "inter_token_latency_seconds_sum")
    assert value(d, "inter_token_latency_seconds_count") == gaps
    assert value(d, "inter_token_latency_seconds_bucket", le="+Inf") == gaps
    assert value(d, "inter_token_latency_seconds_count") == value(d, "step_tokens_total", mode="decode")
    # A request's gaps span its first to its last token, within the time the test waited for it;
    # every decode step ran inside some request's gap, so together they cover the steps' time.
    assert itl_sum <= sum(seconds for _, seconds in outcomes)
    assert itl_sum >= value(d, "step_seconds_sum", mode="decode") * (1 - 1e-9)
    assert (itl_sum > 0) == (gaps > 0)
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in d.items()
                     if name == P + "inter_token_latency_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    # Prefill streams one token per request: no gaps.
    assert value(p, "inter_token_latency_seconds_count") == 0

    # Prefill: each refusal counted once under its reason; a duplicate handshake's first one also
    # times out unclaimed. Decode refused nothing (it has no bootstrap server).
    want = dict(provoked, timeout=provoked["timeout"] + provoked["duplicate"])
    for reason in HANDSHAKE_FAILURE_REASONS:
        assert value(p, "bootstrap_handshake_failures_total", reason=reason) == want[reason], (reason, want)
        assert (P + "bootstrap_handshake_failures_total", frozenset({("reason", reason)})) in d
        assert value(d, "bootstrap_handshake_failures_total", reason=reason) == 0
