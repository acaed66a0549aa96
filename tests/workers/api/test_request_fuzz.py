"""Property-based fuzzing of what a worker accepts: random GenerateRequest protos, any field.

The property (workers/api/validation.py, proto_convert.py, servicer.py): a request either maps
onto a `GenerateRequest` the engines can run as asked — every value in range, the budget inside
the context — or it is refused with `UserError`, which the servicer answers with INVALID_ARGUMENT.
Any other exception, any other status, or a worker that stops serving afterwards is a bug.

Two levels: `to_generate_request` alone (thousands of examples), and the real grpc.aio servicer
over 127.0.0.1 with the scripted engine behind it (fewer: each is a round trip).
"""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.client.scheduler_grpc import SchedulerClient, collect
from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.params import MAX_TOP_LOGPROBS, SamplingParams
from deepseek_pd.workers.engine.interface import GenerateRequest
from deepseek_pd.workers.api.proto_convert import to_generate_request
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig, WorkerServer
from deepseek_pd.workers.api.servicer import WorkerIdentity
from pdtest.servicer_fakes import PAGE_SIZE, FakeEngine, make_tokenizer_model_dir
from pdtest.seeding import examples

pytestmark = pytest.mark.timeout(600)

VOCAB = 300
CONTEXT = 64
INFO = ServedModelInfo(model_path="/m", tokenizer_path="/m", served_model_name="m",
                       max_context_length=CONTEXT, vocab_size=VOCAB, eos_token_ids=(1,), bos_token_id=0,
                       pad_token_id=-1, architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3")

UINT32 = st.integers(0, 2**32 - 1)
INT32 = st.integers(-2**31, 2**31 - 1)
WILD_FLOAT = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.0, -0.0, 1e-7, 1.0000001, 2.0000002, -1.0, -2.0000002]))
JSON = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers(-2**70, 2**70)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


def either(draw, valid, wild):
    """Mostly a value the worker accepts, one time in eight anything the wire type can carry:
    a request is then usually valid in all but one or two fields, which is where bugs hide."""
    return draw(wild) if draw(st.integers(0, 7)) == 0 else draw(valid)


def unit(low: float, high: float):
    return st.floats(low, high, width=32)


@st.composite
def sampling_protos(draw) -> pb.SamplingParams:
    sp = pb.SamplingParams(
        temperature=either(draw, unit(0, 2), WILD_FLOAT),
        top_p=either(draw, unit(0, 1).filter(lambda v: v > 0), WILD_FLOAT),
        top_k=either(draw, st.integers(-1, 50), INT32),
        min_p=either(draw, unit(0, 1), WILD_FLOAT),
        frequency_penalty=either(draw, unit(-2, 2), WILD_FLOAT),
        presence_penalty=either(draw, unit(-2, 2), WILD_FLOAT),
        repetition_penalty=either(draw, unit(0.25, 3), WILD_FLOAT),
        stop=either(draw, st.lists(st.text(min_size=1, max_size=4), max_size=2), st.lists(st.text(max_size=4), max_size=3)),
        stop_token_ids=either(draw, st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(UINT32, max_size=3)),
        skip_special_tokens=draw(st.booleans()), spaces_between_special_tokens=draw(st.booleans()),
        n=either(draw, st.integers(0, 1), UINT32),
        min_new_tokens=either(draw, st.just(0), UINT32),
        ignore_eos=draw(st.booleans()), no_stop_trim=draw(st.booleans()))
    if draw(st.booleans()):
        sp.max_new_tokens = either(draw, st.integers(1, CONTEXT), UINT32)
    if draw(st.booleans()):
        sp.stream_interval = draw(INT32)
    if draw(st.integers(0, 7)) == 0:
        constraint = draw(st.sampled_from(["regex", "json_schema", "ebnf_grammar", "structural_tag"]))
        setattr(sp, constraint, draw(st.text(max_size=6)))
    if draw(st.integers(0, 7)) == 0:
        for key, value in draw(st.dictionaries(st.text(max_size=4), WILD_FLOAT, min_size=1, max_size=2)).items():
            sp.logit_bias[key] = value
    if draw(st.booleans()):
        custom = Struct()
        custom.update(either(draw, st.fixed_dictionaries({"seed": st.integers(-2**63, 2**64 - 1)}),
                             st.dictionaries(st.sampled_from(["seed", "beam", ""]), JSON, max_size=2)))
        sp.custom_params.CopyFrom(custom)
    return sp


@st.composite
def generate_protos(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=either(draw, st.text(min_size=1, max_size=10), st.text(max_size=10)),
        stream=draw(st.booleans()), return_logprob=draw(st.booleans()), logprob_start_len=either(draw, st.just(-1), INT32),
        top_logprobs_num=either(draw, st.integers(0, MAX_TOP_LOGPROBS), INT32),
        token_ids_logprob=either(draw, st.just([]), st.lists(UINT32, max_size=2)),
        return_hidden_states=either(draw, st.just(False), st.booleans()),
        lora_id=either(draw, st.just(""), st.text(max_size=4)))
    if either(draw, st.just(True), st.booleans()):
        ids = either(draw, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=CONTEXT - 1),
                     st.lists(st.one_of(st.integers(0, VOCAB + 3), UINT32), max_size=CONTEXT + 4))
        request.tokenized.CopyFrom(pb.TokenizedInput(original_text=draw(st.text(max_size=6)), input_ids=ids))
    if draw(st.integers(0, 15)) == 0:
        request.input_embeds.extend(draw(st.lists(st.floats(width=32), min_size=1, max_size=3)))
    if either(draw, st.just(True), st.booleans()):
        request.sampling_params.CopyFrom(draw(sampling_protos()))
    if draw(st.booleans()):
        request.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host=either(draw, st.just("127.0.0.1"), st.text(max_size=8)),
            bootstrap_port=either(draw, st.integers(1, 65535), INT32), bootstrap_room=draw(INT32)))
    if draw(st.integers(0, 15)) == 0:
        request.mm_inputs.image_urls.append(draw(st.text(max_size=5)))
    if draw(st.integers(0, 7)) == 0:
        request.data_parallel_rank = draw(INT32)
    return request


def check_servable(request: GenerateRequest, proto: pb.GenerateRequest) -> None:
    """What an accepted request must satisfy for the engines to run it as asked."""
    assert request.rid == proto.request_id and request.rid
    assert 1 <= len(request.input_ids) <= INFO.max_request_input_len
    assert all(0 <= t < VOCAB for t in request.input_ids)
    sampling: SamplingParams = request.sampling
    assert 1 <= sampling.max_new_tokens <= CONTEXT - len(request.input_ids)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        assert math.isfinite(getattr(sampling, name)), name
    assert 0 < sampling.top_p <= 1 and 0 <= sampling.min_p <= 1 and sampling.temperature >= 0
    assert all(0 <= t < VOCAB for t in sampling.stop_token_ids)
    assert sampling.seed is None or (isinstance(sampling.seed, int) and -2**63 <= sampling.seed < 2**64)
    if request.disagg is not None:
        assert request.disagg.bootstrap_host and 0 < request.disagg.bootstrap_port < 65536
    # Top logprobs come with return_logprob (as SGLang), within the cap.
    assert sampling.top_logprobs_num == (proto.top_logprobs_num if proto.return_logprob else 0)
    assert 0 <= sampling.top_logprobs_num <= MAX_TOP_LOGPROBS
    # Features we do not implement never get through silently.
    assert proto.sampling_params.n <= 1 and not proto.token_ids_logprob and not proto.lora_id
    assert not (proto.return_logprob and proto.logprob_start_len >= 0)  # prompt logprobs
    assert proto.sampling_params.WhichOneof("constraint") is None and not proto.sampling_params.logit_bias


@settings(max_examples=examples(3000), suppress_health_check=[HealthCheck.too_slow])
@given(generate_protos())
def test_random_requests_are_servable_or_user_errors(proto: pb.GenerateRequest) -> None:
    try:
        request = to_generate_request(proto, INFO)
    except UserError as exc:
        assert str(exc), "a refusal must say why"
        return
    check_servable(request, proto)


class _Worker:
    """One real grpc.aio servicer on 127.0.0.1 over the scripted engine, on a loop of its own."""

    def __init__(self, info: ServedModelInfo) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # grpc.aio binds a channel to the current loop when made
        self.engine = FakeEngine(scripted=False)  # fuzzed ids 6..8 are prompts, not failure scripts
        self.server = WorkerServer(self.engine, info, WorkerIdentity("decode", "grpc", 0, PAGE_SIZE),
                                   ServerConfig("127.0.0.1", 0, drain_timeout_s=1.0, stop_grace_s=0.5))
        port = self.loop.run_until_complete(self.server.start())
        self.client = SchedulerClient(f"127.0.0.1:{port}")

    def call(self, proto: pb.GenerateRequest) -> grpc.StatusCode:
        async def one():
            try:
                await asyncio.wait_for(collect(self.client.generate(proto)), 30)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                assert exc.details(), "a status must carry a message"
                return exc.code()
        return self.loop.run_until_complete(one())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.run_until_complete(self.server.shutdown())
        self.loop.close()
        asyncio.set_event_loop(None)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    model_dir = make_tokenizer_model_dir(tmp_path_factory.mktemp("fuzz-model"), max_context=CONTEXT)
    running = _Worker(ServedModelInfo.from_model_dir(model_dir, "fake"))
    yield running
    running.close()


@pytest.mark.hypothesis  # its @given is inside: `make fuzz` selects it by this mark
def test_random_requests_over_grpc_are_ok_or_invalid_argument(worker) -> None:
    assert worker.server.servicer._info.vocab_size >= VOCAB  # the fuzzed ids straddle this vocabulary
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=examples(400), suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
    @given(generate_protos())
    def one(proto: pb.GenerateRequest) -> None:
        # A request id the servicer already runs is a different (ALREADY_EXISTS) matter: ids are unique here.
        proto.request_id = f"fuzz-{sum(seen.values())}-{proto.request_id}"
        code = worker.call(proto)
        seen[code] = seen.get(code, 0) + 1
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code
        try:
            to_generate_request(proto, worker.server.servicer._info)
            assert code == grpc.StatusCode.OK
        except UserError:
            assert code == grpc.StatusCode.INVALID_ARGUMENT

    one()
    assert seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
    # Nothing was left behind, and the worker still serves an ordinary request.
    assert worker.server.servicer.num_inflight == 0 and not worker.engine.pages_in_use
    ok = pb.GenerateRequest(request_id="after-fuzz", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                            sampling_params=pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1,
                                                              repetition_penalty=1.0, max_new_tokens=3))
    assert worker.call(ok) == grpc.StatusCode.OK
