"""Failures by meaning (workers/engine/request_failure.py), and each kind reaching the router's gRPC
call with its status and the engine's own message.

The oracle for the message is the same request run against the engine directly (its `Failed`
event); the status is the FailureCode's (proto_convert.STATUS_FOR_FAILURE). Covered here through
a real decode engine (tiny model) behind the real servicer: admission refused (RESOURCE_EXHAUSTED),
an Abort RPC (ABORTED), and a transfer that cannot start (UNAVAILABLE).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.scheduler_grpc import SchedulerClient, sampling_proto
from deepseek_pd.ports import pick_free_ports
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import DisaggParams, Failed, FailureCode, GenerateRequest
from deepseek_pd.workers.api.proto_convert import STATUS_FOR_FAILURE
from deepseek_pd.workers.engine.request_failure import (
    AdmissionRefused, RequestAborted, RequestFailure, TransferError, failure_for)
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.api.servicer import WorkerIdentity
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.pd_engine_harness import PAGE_SIZE, collect, oracle, runner, worker_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("code", list(FailureCode))
def test_failure_for_picks_the_class_by_meaning_and_keeps_code_and_message(code):
    message = f"reason {random.randrange(10**6)}"
    failure = failure_for(code, message, peer_knows=True)
    expected = {FailureCode.ABORTED: RequestAborted, FailureCode.RESOURCE_EXHAUSTED: AdmissionRefused}.get(
        code, TransferError)
    assert type(failure) is expected and isinstance(failure, RequestFailure)
    assert (failure.code, failure.message, str(failure), failure.peer_knows) == (code, message, message, True)


def proto_request(rid: str, prompt, max_new: int, disagg: DisaggParams | None = None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=list(prompt)),
                                 sampling_params=sampling_proto(temperature=0.0, max_new_tokens=max_new,
                                                                ignore_eos=True), stream=True)
    if disagg is not None:
        request.disaggregated_params.bootstrap_host = disagg.bootstrap_host
        request.disaggregated_params.bootstrap_port = disagg.bootstrap_port
        request.disaggregated_params.bootstrap_room = disagg.bootstrap_room
    return request


async def grpc_failure(client: SchedulerClient, request: pb.GenerateRequest, during=None) -> grpc.aio.AioRpcError:
    """Runs `request` to its end over gRPC; `during(client)` once its first token is out."""
    try:
        async for response in client.generate(request):
            if during is not None and response.WhichOneof("response") == "chunk":
                await during(client)
                during = None
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the request succeeded")


def test_each_kind_of_failure_reaches_the_client_with_its_status_and_message():
    rng = random.Random()
    vocab = oracle().vocab_size
    num_pages = rng.randrange(40, 60)
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randrange(3, 9))]
    too_long = num_pages * PAGE_SIZE  # prompt + reserve outgrow the pool: refused at admission
    config = dataclasses.replace(worker_config("grpc", handshake_timeout_s=0.5),
                                 scheduler=dataclasses.replace(worker_config("grpc").scheduler,
                                                               decode_reserve_tokens=10**6))
    dead_port = pick_free_ports(1)[0]  # nothing listens there

    async def run():
        engine = DecodeEngine(runner(num_pages), config, tokenizer=oracle().tokenizer)
        await engine.start()
        server = WorkerServer(engine, ServedModelInfo.from_model_dir(oracle().model_path, "tiny"),
                              WorkerIdentity("decode", "grpc", 0, PAGE_SIZE), ServerConfig("127.0.0.1", 0, 1.0, 0.5))
        port = await server.start()
        outcomes = {}
        try:
            async with SchedulerClient(f"127.0.0.1:{port}") as client:
                # Admission refused: the engine's own Failed, then the same request over gRPC.
                params = SamplingParams(temperature=0.0, max_new_tokens=too_long, ignore_eos=True)
                direct = await collect(engine, GenerateRequest("big-direct", tuple(prompt), params))
                outcomes["admission"] = (direct.terminal, await grpc_failure(
                    client, proto_request("big", prompt, too_long)))
                # Aborted by the Abort RPC once decoding has started.
                outcomes["abort"] = (Failed(FailureCode.ABORTED, "request long aborted"), await grpc_failure(
                    client, proto_request("long", prompt, (num_pages - 4) * PAGE_SIZE),  # fits the pool
                    during=lambda c: c.abort("long")))
                # A transfer whose prefill bootstrap does not answer.
                disagg = DisaggParams("127.0.0.1", dead_port, rng.randrange(1 << 30))
                direct = await collect(engine, GenerateRequest("pd-direct", tuple(prompt), SamplingParams(
                    temperature=0.0, max_new_tokens=4, ignore_eos=True), disagg=disagg))
                outcomes["transfer"] = (direct.terminal, await grpc_failure(
                    client, proto_request("pd", prompt, 4, dataclasses.replace(disagg, bootstrap_room=disagg.bootstrap_room + 1))))
            await asyncio.sleep(0.3)
            assert engine.pool.num_used_pages == 0 and engine.budget.reserved == 0, "pages leaked"
        finally:
            await server.shutdown()
            await engine.stop()
        return outcomes

    outcomes = asyncio.run(run())
    for kind, code in (("admission", FailureCode.RESOURCE_EXHAUSTED), ("abort", FailureCode.ABORTED),
                       ("transfer", FailureCode.UNAVAILABLE)):
        direct, error = outcomes[kind]
        assert isinstance(direct, Failed) and direct.code == code, (kind, direct)
        assert error.code() == STATUS_FOR_FAILURE[code], (kind, error.code(), error.details())
        if kind == "transfer":  # the last connection error inside it differs from attempt to attempt
            assert error.details().split(": ")[0] == direct.message.split(": ")[0], (error.details(), direct.message)
        else:
            assert error.details() == direct.message, (kind, error.details(), direct.message)
