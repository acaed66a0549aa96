"""`TpReplay`: the ranks of one attention-TP group run their leader's forwards, call for call.

Under attention TP (model/attention/tensor_parallel.py) the `tp` ranks of a DP group must run the
same batch at the same time. Only the group's leader (its TP rank 0) schedules: it owns the
engine, the requests and the page allocation. Its runner announces every forward to the others
before running it (`lead`, one broadcast over the TP group), the way SGLang's TP workers receive
the scheduler's batch from TP rank 0; a follower's runner receives the call (`receive`) and runs
the same forward on its own copy of the weights' head slice and of the KV pool, at the same
pages, so every rank's pool holds the same latent rows.

    leader   runner.extend(seqs)  ->  lead(ForwardCall(EXTEND, tokens, prefix_lens, pages))  ->  forward
    follower runner.follow_one()  ->  receive()  ->  the same forward (its logits are dropped)

What else the leader sends with a call:
    input_ids   decode's device-resident token ids (the overlap schedule's samples), broadcast as
                a tensor over the TP group
    hidden      the MTP layer's input hidden states (speculative decoding: `output` "mtp"), a
                tensor over the TP group as well; a speculative verify's call says "hidden"
                (every token's hidden state, absorbed MLA), a plain forward's "logits"
    KV pages    pages whose KV arrived from outside the forwards (a PD transfer into the leader's
                pool, `note_external_kv`): their rows in every layer, before the call that may
                read them, so the followers' pools match the leader's
An idle forward (`ForwardCall(idle=True)`, `output` "mtp" for the MTP layer's) is announced too: the
followers join the other DP groups' MoE collectives with their leader.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kv.pool import KVPool, copy_pages_


@dataclass(frozen=True)
class ForwardCall:
    """One forward of the leader, as its followers replay it."""

    mode: ForwardMode
    idle: bool = False
    token_ids: tuple[tuple[int, ...], ...] = ()
    prefix_lens: tuple[int, ...] = ()
    pages: tuple[tuple[int, ...], ...] = ()
    group_mode: ForwardMode | None = None
    num_input_ids: int = 0  # device input ids follow (decode, overlap schedule); 0: none
    synced_pages: tuple[int, ...] = ()  # KV rows of these pages follow, every layer
    # What the forward computes: "logits" (the model's, of each sequence's last token), "hidden"
    # (the model's hidden states of every token, speculative verify) or "mtp" (the MTP layer's).
    output: str = "logits"
    force_mla: bool = False  # absorbed MLA whatever the policy says (speculative verify)
    hidden_shape: tuple[int, ...] = ()  # "mtp": the input hidden states that follow
    hidden_dtype: torch.dtype | None = None


class TpReplay:
    """One rank's end of its TP group's replay channel (leader or follower).

    `leader` is the global rank of the group's TP rank 0; `host_group` carries the pickled call
    (gloo), `device_group` the tensors (the TP group of `ParallelInfo`; on the CPU the same).
    """

    def __init__(self, leader: int, is_leader: bool, host_group: Any, device_group: Any) -> None:
        self.leader, self.is_leader = leader, is_leader
        self.host_group, self.device_group = host_group, device_group
        self._lock = threading.Lock()
        self._external: list[int] = []

    def note_external_kv(self, pages: Sequence[int]) -> None:
        """(leader) These pages' KV was written outside a forward: send it before the next call."""
        with self._lock:
            self._external.extend(int(p) for p in pages)

    def lead(self, call: ForwardCall, input_ids: torch.Tensor | None, pool: KVPool,
             hidden: torch.Tensor | None = None) -> None:
        """(leader) Announces `call` and sends what comes with it (`hidden`: the MTP layer's
        input hidden states); returns once it is sent."""
        import torch.distributed as dist

        with self._lock:
            synced, self._external = tuple(dict.fromkeys(self._external)), []
        call = replace(call, synced_pages=synced, num_input_ids=0 if input_ids is None else int(input_ids.numel()),
                       hidden_shape=() if hidden is None else tuple(hidden.shape),
                       hidden_dtype=None if hidden is None else hidden.dtype)
        dist.broadcast_object_list([call], src=self.leader, group=self.host_group)
        if call.num_input_ids:
            dist.broadcast(input_ids.contiguous(), src=self.leader, group=self.device_group)
        if hidden is not None:
            dist.broadcast(hidden.contiguous(), src=self.leader, group=self.device_group)
        if synced:
            dist.broadcast(_page_rows(pool, synced), src=self.leader, group=self.device_group)

    def receive(self, pool: KVPool) -> tuple[ForwardCall, torch.Tensor | None, torch.Tensor | None]:
        """(follower) The leader's next call, its device input ids and input hidden states, and its
        KV pages written here."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.host_group)
        call: ForwardCall = box[0]
        device = pool.buffers[0].device
        input_ids = None
        if call.num_input_ids:
            input_ids = torch.empty(call.num_input_ids, dtype=torch.long, device=device)
            dist.broadcast(input_ids, src=self.leader, group=self.device_group)
        hidden = None
        if call.hidden_shape:
            hidden = torch.empty(call.hidden_shape, dtype=call.hidden_dtype, device=device)
            dist.broadcast(hidden, src=self.leader, group=self.device_group)
        if call.synced_pages:
            rows = torch.empty_like(_page_rows(pool, call.synced_pages))
            dist.broadcast(rows, src=self.leader, group=self.device_group)
            index = upload(torch.tensor(call.synced_pages, dtype=torch.long), device)
            for layer, buffer in enumerate(pool.buffers):
                copy_pages_(buffer, index, rows[layer])
        return call, input_ids, hidden


def _page_rows(pool: KVPool, pages: Sequence[int]) -> torch.Tensor:
    """`[layers, len(pages), page_size, dim]`: the pages' latent rows in every layer."""
    index = upload(torch.tensor(pages, dtype=torch.long), pool.buffers[0].device)
    return torch.stack([buffer.index_select(0, index) for buffer in pool.buffers])
