"""`deepseek-pd generate`: one prompt through the offline engine, in this process (ARCHITECTURE §4)."""
from __future__ import annotations

import argparse
import json

from deepseek_pd.errors import UserError
from deepseek_pd.model.sampling.params import DEFAULT_MAX_NEW_TOKENS
from deepseek_pd.model.speculative.rules import DEFAULT_SPECULATIVE_NUM_STEPS, MAX_SPECULATIVE_NUM_STEPS

ATTENTION_METHODS = ("auto", "mha", "mha_chunked_kv", "mla")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate from one prompt in-process (no PD, no server)",
        description="Run one prompt through the offline engine: chunked prefill, then decode over the "
                    "paged latent KV cache. Greedy unless --temperature > 0.")
    parser.add_argument("--model", default="tiny", help="HF checkpoint directory, or 'tiny' (default)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--input-ids", help="comma-separated token ids, e.g. 0,43,72")
    prompt.add_argument("--prompt", help="text; tokenised with the checkpoint's tokenizer (BOS added)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"output budget, capped by the context (default {DEFAULT_MAX_NEW_TOKENS}, as the gRPC API)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    parser.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 disables")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 disables")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--stop", action="append", default=[], help="stop string, repeatable")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past the eos token")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    parser.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                        help="with --json: each output token's logprob and the K most likely tokens' (K <= 20)")
    parser.add_argument("--chunked-prefill-size", type=int, default=2048,
                        help="max prompt tokens per prefill forward; later chunks extend the cached prefix")
    parser.add_argument("--attention-method", choices=ATTENTION_METHODS, default="auto",
                        help="force an attention method for prefill (decode always uses MLA)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: fp32 on CPU; on GPU the checkpoint's torch_dtype (bfloat16 for FP8 checkpoints)")
    parser.add_argument("--device", default="auto",
                        help="torch device: auto (CUDA when available, else cpu; default), cpu, cuda, cuda:N")
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "torch", "triton", "flashinfer", "flashmla"],
                        help="auto: triton on CUDA when it imports, else the torch reference")
    parser.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "triton", "grouped"],
                        help="auto: triton on CUDA when it imports, else the torch reference")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="decode by CUDA-graph replay; default: on where it works (CUDA with the "
                             "triton/grouped backends), --no-cuda-graph turns it off")
    parser.add_argument("--page-size", type=int, default=None,
                        help="KV page size in tokens (default: 64 where FlashMLA's decode can run, else 16; "
                             "model/kv/page_size.py)")
    parser.add_argument("--speculative-num-steps", default="auto", metavar="N",
                        help="tokens the checkpoint's MTP layer drafts per decode step, verified in one forward "
                             f"(0: off; at most {MAX_SPECULATIVE_NUM_STEPS}); auto (default): "
                             f"{DEFAULT_SPECULATIVE_NUM_STEPS} when the checkpoint has an MTP layer, else off")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant kernels and prompt cuts (docs/deterministic.md): greedy output "
                             "equals what a serving worker gives this prompt whatever else it batches")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (output_ids, text, finish_reason, ...) instead of the text")
    parser.set_defaults(func=run)


def parse_input_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UserError(f"--input-ids {text!r} must be comma-separated integers, e.g. 0,43,72")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise UserError(f"--input-ids {text!r} must be comma-separated integers, e.g. 0,43,72") from None


def resolved_runner_config(args: argparse.Namespace):
    """Device, dtype, backends and CUDA graphs decided once, by the rules `serve` uses (the offline
    engine decodes, so graphs default to on where they can be captured)."""
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
    from deepseek_pd.model.runner_config import RunnerConfig

    model_dir = resolve_model_dir(args.model)
    graphs = {} if args.cuda_graph is None else {"cuda_graph": args.cuda_graph}
    return RunnerConfig.resolve(ModelConfig.from_hf(model_dir), graphs_by_default=True, model=str(model_dir),
                                device=args.device, dtype=args.dtype, page_size=args.page_size,
                                attention_backend=args.attention_backend, moe_backend=args.moe_backend,
                                deterministic=args.deterministic, **graphs)


def run(args: argparse.Namespace) -> int:
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.workers.engine.offline import Engine
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.speculative.rules import resolve_speculative_num_steps

    prompt = parse_input_ids(args.input_ids) if args.input_ids is not None else args.prompt
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, stop=tuple(args.stop), ignore_eos=args.ignore_eos, seed=args.seed,
        top_logprobs_num=args.top_logprobs)
    params.validate()  # before loading the model: bad flags fail fast
    runner = resolved_runner_config(args)
    speculative = 0 if args.deterministic and args.speculative_num_steps == "auto" else (
        resolve_speculative_num_steps(args.speculative_num_steps, ModelConfig.from_hf(runner.model).num_nextn_predict_layers))
    engine = Engine(runner.model, dtype=runner.dtype, device=runner.device, attention_method=args.attention_method,
                    chunked_prefill_size=args.chunked_prefill_size, page_size=runner.page_size,
                    attention_backend=runner.attention_backend, moe_backend=runner.moe_backend,
                    cuda_graph=runner.cuda_graph, speculative_num_steps=speculative, deterministic=args.deterministic)
    result = engine.generate(prompt, params)
    if args.json:
        answer = {"output_ids": result.output_ids, "text": result.text, "finish_reason": result.finish_reason,
                  "matched_stop": result.matched_stop, "prompt_tokens": result.prompt_tokens}
        if engine.speculative is not None:
            stats = engine.speculative.stats
            answer["speculative"] = {"num_steps": speculative, "accept_length": stats.accept_length,
                                     "drafted": stats.drafted, "accepted": stats.accepted}
        if args.top_logprobs:  # per token [[id, logprob], ...], most likely first
            answer["output_logprobs"] = result.output_logprobs
            answer["output_top_logprobs"] = [[list(pair) for pair in zip(top.token_ids, top.logprobs)]
                                             for top in result.output_top_logprobs]
        print(json.dumps(answer, ensure_ascii=False))
    else:
        print(result.text)
    return 0
