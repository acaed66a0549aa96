"""The decode side of one PD request's transfer: build the handshake, follow it to TransferDone,
check what arrived (kv_checks.py). A refused or failed transfer's pages may hold anything once its
sink's `exposure` says so (kv_transfer/exposure.py): the engine then zeroes them when it frees them
(DecodeEngine._release), for a one-sided transport after its late-write grace, so that a write
landing after the failure is wiped as well."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import DisaggParams
from deepseek_pd.workers.transport import KVReceiver, KVSink
from deepseek_pd.workers.transport.base import layout_of
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_checks import (
    FiniteOnLanding, check_first_token, check_first_top, check_kv_finite)

log = logging.getLogger(__name__)


async def pull_kv(client: BootstrapClient, receiver: KVReceiver, params: DisaggParams, rid: str,
                  num_tokens: int, pages: Sequence[int], vocab_size: int | None = None,
                  top_logprobs_num: int = 0, sink: KVSink | None = None) -> pb.TransferDone:
    """Gets the prompt's KV into `pages` (already allocated) and checks it; raises a RequestFailure.
    `vocab_size`: the first token must be below it (the engine always passes it), and so must the
    `top_logprobs_num` top logprobs that come with it. `sink`: `receiver.open_sink(pages,
    params.bootstrap_host)` by the caller, who reads its `exposure` after a failure (default: one
    opened here); it adds its own offer to the handshake (`offer_into`)."""
    handshake = pb.Handshake(decode_rid=rid, num_tokens=num_tokens, page_ids=list(pages),
                             layout=layout_of(receiver.pool))
    receiver.fill_destination(handshake)
    started = time.monotonic()
    if sink is None:
        sink = receiver.open_sink(pages, params.bootstrap_host)
    # A sink that lands the KV as it comes (mooncake, grpc) checks each part then, off the first token's path.
    sink.check_on_landing(FiniteOnLanding(receiver.pool, rid))
    try:
        # mooncake: staging slots (waits here, on the loop, while they are all taken): queueing for
        # them is bounded as queueing at the prefill side is, by the transfer's deadline.
        await sink.reserve(client.config.transfer_timeout_s)
        if sink.registers_pages:  # mooncake: its staging slots are reachable only from here...
            await asyncio.to_thread(sink.expose)
        sink.offer_into(handshake)  # (after expose: the slots it took are the pages to write)
        done = await client.transfer(params, handshake, sink)
    except BaseException:
        sink.withdraw()  # ...to here, whatever the outcome (on the loop: a cancelled task may not wait)
        raise
    # Withdraws, and (mooncake) copies the staging into the pages: what is checked below is a private
    # copy no writer reaches (a registration costs ~14 us; thousands of page runs take ms).
    if sink.registers_pages:
        await asyncio.to_thread(sink.land)
    else:
        sink.land()  # (nothing to undo or copy: no thread hop on the first token's path)
    if vocab_size is not None:
        check_first_token(done, vocab_size, rid)
        check_first_top(done, vocab_size, top_logprobs_num, rid)
    # Only now that no writer reaches the pages: a stranger's write into the transfer fails it here.
    # Both checks only read the pages, so they run side by side (both on the first token's path);
    # the MAC's verdict wins when both refuse (a stranger's NaN is a stranger's write). A MAC
    # built as the sends landed (`KVSink.begin_check`) only digests: on the loop, no thread hop.
    key = client.config.auth.kv_key(params.bootstrap_room, handshake.auth.nonce)
    # The finite check ran as each part landed (mooncake, grpc): only its verdict is left, after the MAC's.
    landed = sink.checked_on_landing()
    finite = None if landed else asyncio.get_running_loop().run_in_executor(
        None, check_kv_finite, receiver.pool, pages, rid)
    try:
        if key is not None and sink.check_reads():  # (no key: nothing to check)
            await asyncio.to_thread(sink.check_sealed, done, key, params.bootstrap_room)
        else:
            sink.check_sealed(done, key, params.bootstrap_room)
    finally:  # (the finite check ends before the pages can be freed)
        refused = sink.landing_failure if landed else (await asyncio.gather(finite, return_exceptions=True))[0]
    if isinstance(refused, BaseException):
        raise refused
    seconds = max(time.monotonic() - started, 1e-9)
    log.debug("%s: received %d bytes of KV for %d tokens (%d cached on prefill) in %.3fs, %.3f GB/s "
              "including prefill compute; %s", rid, done.bytes_sent, num_tokens, done.cached_tokens, seconds,
              done.bytes_sent / seconds / 1e9, sink.stats.summary())
    return done

