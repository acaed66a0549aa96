"""The decode side of one PD request's transfer: build the handshake, follow it to TransferDone."""
from __future__ import annotations

import logging
import time
from typing import Sequence

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.common.api import DisaggParams
from deepseek_pd.workers.common.kv_transfer import KVReceiver
from deepseek_pd.workers.common.kv_transfer.base import layout_of
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient

log = logging.getLogger(__name__)


async def pull_kv(client: BootstrapClient, receiver: KVReceiver, params: DisaggParams, rid: str,
                  num_tokens: int, pages: Sequence[int]) -> pb.TransferDone:
    """Gets the prompt's KV into `pages` (already allocated); raises TransferError on failure."""
    handshake = pb.Handshake(decode_rid=rid, num_tokens=num_tokens, page_ids=list(pages),
                             layout=layout_of(receiver.pool))
    receiver.fill_destination(handshake)
    started = time.monotonic()
    sink = receiver.open_sink(pages)
    done = await client.transfer(params, handshake, sink)
    seconds = max(time.monotonic() - started, 1e-9)
    log.debug("%s: received %d bytes of KV for %d tokens (%d cached on prefill) in %.3fs, %.3f GB/s "
              "including prefill compute; %s", rid, done.bytes_sent, num_tokens, done.cached_tokens, seconds,
              done.bytes_sent / seconds / 1e9, sink.stats.summary())
    return done
