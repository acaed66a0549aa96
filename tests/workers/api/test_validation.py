"""Proto -> GenerateRequest mapping and validation, without a server (workers/api/proto_convert.py)."""
from __future__ import annotations

import random

import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.params import DEFAULT_MAX_NEW_TOKENS
from deepseek_pd.workers.api.proto_convert import to_generate_request
from deepseek_pd.workers.api.served_model import ServedModelInfo

pytestmark = pytest.mark.timeout(60)

INFO = ServedModelInfo(model_path="/m", tokenizer_path="/m", served_model_name="m",
                       max_context_length=64, vocab_size=300, eos_token_ids=(1,), bos_token_id=0,
                       pad_token_id=-1, architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3")


def good_request(rng: random.Random, **sampling) -> pb.GenerateRequest:
    fields = dict(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.uniform(0.05, 1.0),
                  top_k=rng.choice([-1, 0, 1, 20]), min_p=rng.uniform(0, 1),
                  repetition_penalty=rng.uniform(0.5, 2), frequency_penalty=rng.uniform(-2, 2),
                  presence_penalty=rng.uniform(-2, 2), max_new_tokens=rng.randint(1, 20),
                  stop_token_ids=[rng.randrange(300)], stop=["\n\n"], ignore_eos=rng.random() < 0.5,
                  skip_special_tokens=True, n=rng.choice([0, 1]))
    fields.update(sampling)
    n_input = rng.randint(1, 40)
    return pb.GenerateRequest(
        request_id=f"r{rng.randrange(10**9)}",
        tokenized=pb.TokenizedInput(input_ids=[rng.randrange(300) for _ in range(n_input)]),
        sampling_params=pb.SamplingParams(**fields), stream=rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(20))
def test_valid_requests_map_field_for_field(seed: int) -> None:
    rng = random.Random(seed)
    proto = good_request(rng)
    req = to_generate_request(proto, INFO)
    sp, mapped = proto.sampling_params, req.sampling
    assert req.rid == proto.request_id and req.stream == proto.stream
    assert req.input_ids == tuple(proto.tokenized.input_ids)
    assert req.disagg is None
    assert mapped.max_new_tokens == min(sp.max_new_tokens, INFO.max_context_length - len(req.input_ids))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        assert getattr(mapped, name) == pytest.approx(getattr(sp, name)), name
    assert mapped.top_k == sp.top_k and mapped.ignore_eos == sp.ignore_eos
    assert mapped.stop_token_ids == tuple(sp.stop_token_ids) and mapped.stop == tuple(sp.stop)


def test_disaggregated_params_and_seed_and_defaults() -> None:
    rng = random.Random(1)
    proto = good_request(rng)
    room = rng.randrange(2**31 - 1)
    proto.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
        bootstrap_host="10.0.0.7", bootstrap_port=8998, bootstrap_room=room))
    proto.sampling_params.custom_params.update({"seed": 1234})
    proto.sampling_params.ClearField("max_new_tokens")
    proto.tokenized.input_ids[:] = [5, 6, 7]
    req = to_generate_request(proto, INFO)
    assert (req.disagg.bootstrap_host, req.disagg.bootstrap_port, req.disagg.bootstrap_room) == \
        ("10.0.0.7", 8998, room)
    assert req.sampling.seed == 1234
    # No budget given: SGLang's default, clipped to the context that is left.
    assert req.sampling.max_new_tokens == min(DEFAULT_MAX_NEW_TOKENS, INFO.max_context_length - 3)


def _custom(values: dict) -> Struct:
    struct = Struct()
    struct.update(values)
    return struct


BAD_CASES = {
    "empty input": (lambda r: r.tokenized.ClearField("input_ids"), "prompt is empty"),
    "no tokenized": (lambda r: r.ClearField("tokenized"), "tokenized input is required"),
    "too long": (lambda r: r.tokenized.input_ids.extend([3] * 64), "maximum context is"),
    "token out of vocab": (lambda r: r.tokenized.input_ids.append(300), "outside the vocabulary"),
    "max_new_tokens 0": (lambda r: setattr(r.sampling_params, "max_new_tokens", 0), "max_new_tokens"),
    "top_p 0": (lambda r: setattr(r.sampling_params, "top_p", 0.0), "top_p"),
    "top_p > 1": (lambda r: setattr(r.sampling_params, "top_p", 1.5), "top_p"),
    "negative temperature": (lambda r: setattr(r.sampling_params, "temperature", -0.5), "temperature"),
    "repetition_penalty 0": (lambda r: setattr(r.sampling_params, "repetition_penalty", 0.0),
                             "repetition_penalty"),
    "top_k -5": (lambda r: setattr(r.sampling_params, "top_k", -5), "top_k"),
    "n 2": (lambda r: setattr(r.sampling_params, "n", 2), "n=2"),
    "regex": (lambda r: setattr(r.sampling_params, "regex", "[a-z]+"), "structured output (regex)"),
    "json_schema": (lambda r: setattr(r.sampling_params, "json_schema", "{}"), "json_schema"),
    "logit_bias": (lambda r: r.sampling_params.logit_bias.update({"5": 1.0}), "logit_bias"),
    "min_new_tokens": (lambda r: setattr(r.sampling_params, "min_new_tokens", 3), "min_new_tokens"),
    "stop id out of vocab": (lambda r: r.sampling_params.stop_token_ids.append(999), "stop_token_ids"),
    "unknown custom param": (lambda r: r.sampling_params.custom_params.CopyFrom(_custom({"beam": 4})),
                             "unknown custom_params"),
    "fractional seed": (lambda r: r.sampling_params.custom_params.CopyFrom(_custom({"seed": 1.5})), "seed"),
    "text seed": (lambda r: r.sampling_params.custom_params.CopyFrom(_custom({"seed": "abc"})), "seed"),
    "list seed": (lambda r: r.sampling_params.custom_params.CopyFrom(_custom({"seed": [1, 2]})), "seed"),
    # A torch generator takes 64-bit seeds; a larger one would fail deep in the engine (INTERNAL).
    "seed beyond 64 bits": (lambda r: r.sampling_params.custom_params.CopyFrom(_custom({"seed": 1e20})), "seed"),
    "lora": (lambda r: setattr(r, "lora_id", "adapter-1"), "LoRA"),
    "hidden states": (lambda r: setattr(r, "return_hidden_states", True), "return_hidden_states"),
    "top logprobs over the cap": (lambda r: (setattr(r, "return_logprob", True), setattr(r, "logprob_start_len", -1),
                                             setattr(r, "top_logprobs_num", 21)), "top_logprobs_num"),
    "negative top logprobs": (lambda r: (setattr(r, "return_logprob", True), setattr(r, "logprob_start_len", -1),
                                         setattr(r, "top_logprobs_num", -2)), "top_logprobs_num"),
    "token ids logprob": (lambda r: r.token_ids_logprob.extend([3, 4]), "token_ids_logprob"),
    "prompt logprobs": (lambda r: (setattr(r, "return_logprob", True), setattr(r, "logprob_start_len", 0)),
                        "logprob_start_len"),
    "input embeds": (lambda r: r.input_embeds.extend([0.5, 0.25]), "input_embeds"),
    "multimodal": (lambda r: r.mm_inputs.image_urls.append("http://x/y.png"), "multimodal"),
    "empty request id": (lambda r: setattr(r, "request_id", ""), "request_id"),
    "bootstrap port 0": (lambda r: r.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(bootstrap_host="h", bootstrap_port=0, bootstrap_room=1)), "bootstrap_port"),
    "bootstrap host empty": (lambda r: r.disaggregated_params.CopyFrom(
        pb.DisaggregatedParams(bootstrap_host="", bootstrap_port=9, bootstrap_room=1)), "bootstrap_host"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_requests_raise_user_error_naming_the_problem(case: str) -> None:
    mutate, expected_words = BAD_CASES[case]
    proto = good_request(random.Random(hash(case) % 1000))
    mutate(proto)
    with pytest.raises(UserError, match=expected_words.replace("(", r"\(").replace(")", r"\)")):
        to_generate_request(proto, INFO)


def test_served_model_info_reads_checkpoint(tmp_path) -> None:
    from pdtest.servicer_fakes import EOS, make_tokenizer_model_dir

    model_dir = make_tokenizer_model_dir(tmp_path / "m", max_context=77)
    info = ServedModelInfo.from_model_dir(model_dir, "served")
    assert info.max_context_length == 77 and info.max_request_input_len == 76
    assert info.eos_token_ids == (EOS,) and info.served_model_name == "served"
    assert info.architectures == ("DeepseekV3ForCausalLM",)
    with pytest.raises(UserError, match="config.json not found"):
        ServedModelInfo.from_model_dir(tmp_path / "missing")
