"""The decode side of one PD request's transfer: build the handshake, follow it to TransferDone."""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.common.api import DisaggParams
from deepseek_pd.workers.common.kv_transfer import KVReceiver
from deepseek_pd.workers.common.kv_transfer.base import layout_of
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient


async def pull_kv(client: BootstrapClient, receiver: KVReceiver, params: DisaggParams, rid: str,
                  num_tokens: int, pages: Sequence[int]) -> pb.TransferDone:
    """Gets the prompt's KV into `pages` (already allocated); raises TransferError on failure."""
    handshake = pb.Handshake(decode_rid=rid, num_tokens=num_tokens, page_ids=list(pages),
                             layout=layout_of(receiver.pool))
    receiver.fill_destination(handshake)
    return await client.transfer(params, handshake, receiver.open_sink(pages))
