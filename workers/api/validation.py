"""Rejects Generate requests this worker cannot serve faithfully, before any engine sees them.

Every check raises `UserError` with a message that names the field; the servicer turns it into
gRPC INVALID_ARGUMENT. A feature we do not implement (n > 1, grammar constraints, logit bias,
multimodal input, LoRA, hidden states, prompt logprobs, token_ids_logprob) is refused rather than silently ignored: a
client that asked for JSON-constrained output must not get free text back.

The sampling values themselves (top_p in (0, 1], penalties, ...) are checked by
`SamplingParams.validate`, after the proto has been mapped onto it.
"""
from __future__ import annotations

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from deepseek_pd.errors import UserError
from deepseek_pd.workers.engine.request_rules import check_prompt, check_prompt_length
from deepseek_pd.workers.api.served_model import ServedModelInfo

# Keys of `sampling_params.custom_params` that we understand; anything else is refused.
SUPPORTED_CUSTOM_PARAMS = frozenset({"seed"})


def check_input(request: pb.GenerateRequest, info: ServedModelInfo) -> tuple[int, ...]:
    """Returns the prompt's token ids after checking presence, then the shared prompt rules
    (workers/engine/request_rules.py: length, vocabulary range)."""
    if len(request.input_embeds) > 0:
        raise UserError("input_embeds is not supported: send tokenized.input_ids")
    if not request.HasField("tokenized"):
        raise UserError("tokenized input is required (GenerateRequest.tokenized.input_ids)")
    # The length of the parsed repeated field costs nothing; copying it into Python ints costs
    # ~30 bytes and a few ns per token. So the length is checked first: a 64 MiB message (16M ids)
    # is refused without materialising it, and at most `max_request_input_len` ids are ever copied.
    check_prompt_length(len(request.tokenized.input_ids), info.max_context_length)
    input_ids = tuple(request.tokenized.input_ids)
    if not input_ids or max(input_ids) >= info.vocab_size:  # built-in scan; the rule's own scan words the error
        check_prompt(input_ids, info.vocab_size, info.max_context_length)
    return input_ids


def check_unsupported(request: pb.GenerateRequest) -> None:
    """Refuses request features that this worker does not implement."""
    sp = request.sampling_params
    if request.HasField("mm_inputs") and request.mm_inputs.ByteSize() > 0:
        raise UserError("multimodal inputs (mm_inputs) are not supported by this text-only model")
    if request.return_hidden_states:
        raise UserError("return_hidden_states is not supported")
    if request.lora_id:
        raise UserError(f"lora_id={request.lora_id!r}: LoRA adapters are not supported")
    if request.custom_logit_processor:
        raise UserError("custom_logit_processor is not supported")
    if len(request.token_ids_logprob) > 0:
        raise UserError("token_ids_logprob is not supported; return_logprob gives the sampled tokens' "
                        "logprobs and top_logprobs_num the most likely tokens' ones")
    if request.return_logprob and request.logprob_start_len >= 0:
        # Prompt logprobs need logits at every prompt position; the runner returns the last only.
        raise UserError(f"logprob_start_len={request.logprob_start_len}: input (prompt) logprobs are not "
                        "supported; send logprob_start_len=-1 (SGLang's default) for output logprobs only")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise UserError(f"data_parallel_rank={request.data_parallel_rank}: this worker has one DP rank")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        raise UserError(f"structured output ({constraint}) is not supported")
    if sp.n > 1:
        raise UserError(f"n={sp.n}: only one sample per request is supported (n=1)")
    if len(sp.logit_bias) > 0:
        raise UserError("logit_bias is not supported")
    if sp.min_new_tokens > 0:
        raise UserError(f"min_new_tokens={sp.min_new_tokens} is not supported")
    if sp.HasField("custom_params"):
        unknown = sorted(set(sp.custom_params.keys()) - SUPPORTED_CUSTOM_PARAMS)
        if unknown:
            raise UserError(f"unknown custom_params {unknown}; supported: {sorted(SUPPORTED_CUSTOM_PARAMS)}")


def check_disaggregated(request: pb.GenerateRequest) -> None:
    """A PD request must say where the prefill bootstrap service is."""
    if not request.HasField("disaggregated_params"):
        return
    dp = request.disaggregated_params
    if not dp.bootstrap_host:
        raise UserError("disaggregated_params.bootstrap_host is empty")
    if not 0 < dp.bootstrap_port < 65536:
        raise UserError(f"disaggregated_params.bootstrap_port={dp.bootstrap_port} is not a TCP port")
