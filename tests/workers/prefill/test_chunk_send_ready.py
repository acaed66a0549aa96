"""The CPU side of the per-chunk send order (its GPU check: test_chunk_send_order_cuda.py).

A chunk's pages go to the transport after its forward returned, when the scheduler may already
have queued the next forward. On CUDA the copy must therefore wait for an event marking "every
forward so far" (`kv_written_event`), never for the stream itself (a `ready` of None), which
would include that next forward. Here, on CPU, the event is replaced by numbered marks and the
forwards are logged: every send must carry a mark taken after the forward that computed its
pages and before the next forward began, and the copy (direct, and the byte stream's gather) must
be handed that same mark.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from dataclasses import dataclass

import pytest

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.transport import grpc_stream, page_io
from deepseek_pd.workers.prefill import engine as prefill_engine
from pdtest.pd_engine_harness import CHUNK, PDPair, oracle, worker_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)


@dataclass(frozen=True)
class Mark:
    """Stands for a CUDA event: `seq` orders it among the forwards in `log`."""

    seq: int

    def query(self) -> bool:  # as torch.cuda.Event.query: the marked work is done (CPU: it is)
        return True


@pytest.mark.parametrize("direct", ["on", "off"])
def test_each_chunks_send_waits_for_a_mark_between_its_forward_and_the_next(direct, monkeypatch) -> None:
    rng = random.Random()
    prompt = [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randint(2, 4) * CHUNK + rng.randrange(1, CHUNK))]
    log: list[tuple[str, object]] = []
    counter = itertools.count()

    def mark(device) -> Mark:
        made = Mark(next(counter))
        log.append(("mark", made))
        return made
    monkeypatch.setattr(prefill_engine, "kv_written_event", mark)
    copies: list[object] = []  # the `ready` each copy (direct write, or the byte stream's gather) got
    write_pages, gather = grpc_stream.write_pages, page_io.PageGather.gather

    def traced_write(src, dst, layers, src_pages, dst_pages, ready):
        copies.append(ready)
        return write_pages(src, dst, layers, src_pages, dst_pages, None)  # a CPU pool waits for nothing

    def traced_gather(self, layers, pages, ready=None, on_slot_wait=None):
        copies.append(ready)
        return gather(self, layers, pages, None, on_slot_wait)
    monkeypatch.setattr(grpc_stream, "write_pages", traced_write)
    monkeypatch.setattr(page_io.PageGather, "gather", traced_gather)

    async def run():
        base = worker_config("grpc", same_host_direct=direct)
        cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, layerwise_transfer=False))
        async with PDPair("grpc", prefill_config=cfg, decode_config=cfg) as pair:
            open_channel, extend = pair.prefill.sender.open, pair.prefill.runner.extend

            def traced_open(handshake, emit, streams=1):
                channel = open_channel(handshake, emit, streams)
                send = channel.send

                async def traced_send(src_pages, page_begin, layer_begin=0, layer_end=None, ready=None):
                    log.append(("send", ready))
                    await send(src_pages, page_begin, layer_begin, layer_end, ready)
                channel.send = traced_send
                log.append(("channel", type(channel).__name__))
                return channel

            def traced_extend(seqs, progress=None, **kwargs):
                log.append(("forward", "start"))
                try:
                    return extend(seqs, progress=progress, **kwargs)
                finally:
                    log.append(("forward", "end"))
            pair.prefill.sender.open, pair.prefill.runner.extend = traced_open, traced_extend
            outcome = await pair.run(prompt, GREEDY, "ready")
            await pair.wait_pools_clean()
            return outcome

    prefill, decode = asyncio.run(run())
    assert prefill.ok and decode.ok, (prefill.terminal, decode.terminal)
    assert ("channel", "DirectChannel" if direct == "on" else "GrpcChannel") in log
    forwards = [i for i, (kind, what) in enumerate(log) if kind == "forward" and what == "start"]
    assert len(forwards) == -(-len(prompt) // CHUNK)
    sends = [(i, ready) for i, (kind, ready) in enumerate(log) if kind == "send"]
    assert sends, log
    for at, ready in sends:
        assert isinstance(ready, Mark), f"a send without a mark waits for the whole stream: {log}"
        taken = log.index(("mark", ready))
        ended = max(i for i, entry in enumerate(log[:taken]) if entry == ("forward", "end"))
        later = [i for i in forwards if i > ended]
        # Taken after the forward that computed the pages, before the next one was started.
        assert all(taken < i for i in later), log
        assert not any(entry == ("forward", "start") for entry in log[ended:taken]), log
    # Each copy waited for its send's mark (merged sends: the last one's).
    assert copies and all(isinstance(ready, Mark) for ready in copies)
    assert set(copies) <= {ready for _, ready in sends}
