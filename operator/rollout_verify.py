"""Verified rollouts: before a new-revision decode group takes traffic, it must answer a fixed set of
greedy requests with the same tokens as an old-revision group answering them at the same time.

    PROMPTS          short token-id prompts (ids < 400: inside every vocabulary, the tiny test
                     model's 446 too), batch 1, greedy, MAX_NEW_TOKENS each, sent straight over
                     the workers' gRPC API
                     (SglangScheduler.Generate without disaggregated_params: a decode worker
                     answers it as ordinary colocated generation)
    same tokens      the group is verified and joins the router
    a difference     `TokensDiffer`: prompt i, position j, old token vs new token; the rollout
                     stops (no further group is replaced) and the old groups keep serving

A prefill group cannot answer alone: `verify_prefill` sends PROMPTS as PD requests (the router's
dual dispatch, client/pd_dispatch.py) through the old prefill group and then through the new one,
both paired with the same ready decode group, one request at a time (so the decode group runs
batch 1 both times and its numerics cannot differ between the two).

The check applies only when the model is unchanged (image, engine or resource changes); a new
checkpoint may change tokens legitimately (rollout_reconcile.py compares the groups' model_path).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from deepseek_pd.client.pd_dispatch import PDClient
from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect, sampling_proto
from smg_grpc_proto import sglang_scheduler_pb2 as pb

PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 15, 27, 42), (3, 141, 59, 265, 358, 97), (100, 200, 300), (7, 7, 7, 7, 7, 7, 7, 7),
)
MAX_NEW_TOKENS = 8
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Mismatch:
    prompt: int          # index into PROMPTS
    position: int        # first output position that differs
    old: int | None      # None: the old group's output ended earlier
    new: int | None

    def __str__(self) -> str:
        return (f"prompt {self.prompt} {list(PROMPTS[self.prompt])}: output token {self.position} is "
                f"{self.new} on the new revision, {self.old} on the old one")


def first_mismatch(old: list[list[int]], new: list[list[int]]) -> Mismatch | None:
    """The first prompt (in order) whose outputs differ, at their first differing position."""
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        for j in range(max(len(a), len(b))):
            x = a[j] if j < len(a) else None
            y = b[j] if j < len(b) else None
            if x != y:
                return Mismatch(i, j, x, y)
    return None


async def greedy_outputs(address: str) -> list[list[int]]:
    """Every prompt of PROMPTS, one at a time (batch 1), greedy."""
    outputs = []
    async with SchedulerClient(address) as client:
        for i, prompt in enumerate(PROMPTS):
            request = pb.GenerateRequest(request_id=f"rollout-verify-{i}",
                                         tokenized=pb.TokenizedInput(input_ids=list(prompt)),
                                         sampling_params=sampling_proto(max_new_tokens=MAX_NEW_TOKENS),
                                         stream=False)
            ids, _ = await collect(client.generate(request, timeout_s=TIMEOUT_S))
            outputs.append(ids)
    return outputs


async def verify(new_address: str, old_address: str) -> Mismatch | None:
    """Both groups answer PROMPTS at the same time; raises what a call raised (e.g. grpc errors)."""
    new, old = await asyncio.gather(greedy_outputs(new_address), greedy_outputs(old_address))
    return first_mismatch(old, new)


@dataclass(frozen=True)
class PrefillGroup:
    """Where a prefill group's leader answers: its gRPC address and its bootstrap endpoint."""

    address: str
    bootstrap_host: str
    bootstrap_port: int


async def pd_greedy_outputs(prefill: PrefillGroup, decode_address: str) -> list[list[int]]:
    """Every prompt of PROMPTS through `prefill` then `decode_address`, one at a time, greedy."""
    outputs = []
    async with PDClient(prefill.address, prefill.bootstrap_host, prefill.bootstrap_port, decode_address) as pd:
        for i, prompt in enumerate(PROMPTS):
            result = await pd.generate(list(prompt), sampling_proto(max_new_tokens=MAX_NEW_TOKENS),
                                       timeout_s=TIMEOUT_S, request_id=f"rollout-verify-prefill-{i}")
            error = result.prefill_error or result.decode_error
            if error is not None:
                raise error
            outputs.append(result.output_ids)
    return outputs


async def verify_prefill(new: PrefillGroup, old: PrefillGroup, decode_address: str) -> Mismatch | None:
    """The old prefill group's answers, then the new one's, through the same decode group."""
    old_outputs = await pd_greedy_outputs(old, decode_address)
    return first_mismatch(old_outputs, await pd_greedy_outputs(new, decode_address))
