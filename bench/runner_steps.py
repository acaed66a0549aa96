"""The model runner alone, at a serving workload's shapes: one prompt's prefill, one decode step.

What the serving numbers are read against (`bench/serving_gpu.py` runs this in its own process
first, so its memory is back before the workers start):
- prefill: `runner.extend` of ONE prompt per call, at each given prompt length (the lengths of
  the c=1 workload), median of `--repeats` calls each;
- a prefill round: one `runner.extend` of as many of those prompts as fit in
  `--prefill-round-tokens` (the prefill worker's chunked_prefill_size), the rate at which a busy
  prefill worker computes prompts (what bounds serving throughput on one GPU, serving_report.py);
- decode: at each batch size, sequences whose contexts are drawn like the workload's (a prompt
  length in [--context-min, --context-max] plus --decode-offset generated tokens), prefilled, then
  `--steps` teacher-forced steps of `runner.decode` (CUDA-graph replay when the runner captures
  graphs) timed two ways: `step_ms` with one device sync at the end (the step's device time when
  the host keeps ahead), and `step_sync_ms` reading the argmax tokens back every step (what a
  scheduler that samples on the host pays at least);
- the loads apart (`bench/solo_levels.py`), when asked: `prefill_only_round`, a round of
  `--prefill-only-len` prompts (the prefill-only load's, filled to the round as above), and
  `decode_only`, the decode step at `--decode-only-batches` with every context at
  `--decode-only-context` (the decode-only load's prompt plus half its output: its mean context).

    python bench/runner_steps.py --model DIR --device cuda --dtype bfloat16 --page-size 64 \\
        --cuda-graph --prefill-lengths 600,800,1000 --batches 1,16,64,128 --out runner.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import dataclasses
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RunnerStepsSpec:
    model: str
    device: str = "cuda"
    dtype: str = "bfloat16"
    page_size: int = 64
    cuda_graph: bool = True
    backend: str = "auto"  # attention and MoE backend ("triton" on the GPU)
    num_fused_shared_experts: int = 0
    prefill_lengths: tuple[int, ...] = (512, 768, 1024)
    batches: tuple[int, ...] = (1, 16, 64, 128)
    context_min: int = 512
    context_max: int = 1024
    decode_offset: int = 64  # decode steps already taken: the middle of a 128-token output
    steps: int = 32
    repeats: int = 3
    seed: int = 0
    enable_tbo: bool = False  # two-batch overlap (eager: CUDA graphs cannot capture it)
    prefill_round_tokens: int = 2048  # the prefill worker's chunked_prefill_size
    prefill_only_len: int = 0  # > 0: also time a round of prompts of this length (prefill-only load)
    decode_only_context: int = 0  # > 0: also time decode steps at this context ...
    decode_only_batches: tuple[int, ...] = ()  # ... at these batches (decode-only load)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def runner_config(spec: RunnerStepsSpec) -> "RunnerConfig":
    """The runner these figures are of (bench/prefill_host_overhead.py compares the prefill worker's
    resolved config with it); its pool is sized by `measure`."""
    from deepseek_pd.model.runner_config import RunnerConfig

    return RunnerConfig(model=spec.model, dtype=spec.dtype, device=spec.device, page_size=spec.page_size,
                        cuda_graph=spec.cuda_graph, attention_backend=spec.backend, moe_backend=spec.backend,
                        num_fused_shared_experts=spec.num_fused_shared_experts, enable_tbo=spec.enable_tbo)


@torch.inference_mode()
def measure(spec: RunnerStepsSpec) -> dict:
    from deepseek_pd.model.runner import ExtendSeq, ModelRunner

    rng = random.Random(spec.seed)
    longest = max(spec.context_max + spec.decode_offset + spec.steps + 2, max(spec.prefill_lengths))
    pages_per_seq = -(-longest // spec.page_size)
    rounds = [round_lengths(spec.prefill_lengths, spec.prefill_round_tokens)]
    if spec.prefill_only_len:
        rounds.append(round_lengths((spec.prefill_only_len,), spec.prefill_round_tokens))
    round_pages = max(sum(-(-n // spec.page_size) for n in lengths) for lengths in rounds)
    only_pages = max(spec.decode_only_batches, default=0) * -(-(spec.decode_only_context + spec.steps + 2)
                                                              // spec.page_size)
    # The decode batches, one prompt, the prefill rounds, the graphs' scratch page (each at its own time).
    num_pages = max(max(spec.batches) * pages_per_seq + pages_per_seq, round_pages, only_pages) + 8
    t0 = time.perf_counter()
    runner = ModelRunner(dataclasses.replace(runner_config(spec), num_pages=num_pages))
    _sync(spec.device)
    result: dict = {"spec": asdict(spec), "load_and_capture_s": time.perf_counter() - t0,
                    "kv_bytes_per_token": runner.kv_pool.bytes_per_token,
                    "device_name": torch.cuda.get_device_name() if spec.device.startswith("cuda") else "cpu",
                    "torch": torch.__version__}
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    # Prefill: one prompt per call; the first call also compiles, so it runs once untimed.
    pages = pool.alloc(pages_per_seq)
    runner.extend([ExtendSeq(tokens(spec.prefill_lengths[0]), 0, pages)])
    per_length = []
    for length in spec.prefill_lengths:
        prompt, times = tokens(length), []
        for _ in range(spec.repeats):
            _sync(spec.device)
            start = time.perf_counter()
            runner.extend([ExtendSeq(prompt, 0, pages)])
            _sync(spec.device)
            times.append(time.perf_counter() - start)
        per_length.append({"length": length, "ms": statistics.median(times) * 1e3})
    pool.free(pages)
    result["prefill"] = per_length
    result["prefill_ms_median"] = statistics.median(row["ms"] for row in per_length)
    result["prefill_round"] = _prefill_round(runner, spec, tokens, spec.prefill_lengths)
    if spec.prefill_only_len:
        result["prefill_only_round"] = _prefill_round(runner, spec, tokens, (spec.prefill_only_len,))
    result["decode"] = _decode_steps(runner, spec, tokens, spec.batches,
                                     lambda: rng.randint(spec.context_min, spec.context_max) + spec.decode_offset)
    if spec.decode_only_batches:
        result["decode_only"] = _decode_steps(runner, spec, tokens, spec.decode_only_batches,
                                              lambda: spec.decode_only_context)
    return result


def _decode_steps(runner, spec: RunnerStepsSpec, tokens, batches: tuple[int, ...], context) -> list[dict]:
    """Per batch: sequences of `context()` tokens each, prefilled, then `spec.steps` timed steps."""
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq

    pool = runner.kv_pool
    decode = []
    for batch in batches:
        contexts = [context() for _ in range(batch)]
        seq_pages = [pool.alloc(pool.pages_for_tokens(c + spec.steps + 2)) for c in contexts]
        for lo in range(0, batch, 16):  # prefill the contexts, 16 sequences per call
            runner.extend([ExtendSeq(tokens(contexts[i]), 0, seq_pages[i])
                           for i in range(lo, min(batch, lo + 16))])
        ids = tokens(batch)

        def step(offset: int) -> torch.Tensor:
            return runner.decode([DecodeSeq(ids[i], contexts[i] + offset, seq_pages[i])
                                  for i in range(batch)]).argmax(-1)

        step(0)  # warm-up (and the first replay of this bucket)
        _sync(spec.device)
        start = time.perf_counter()
        for s in range(spec.steps):
            step(1 + s % 2)
        _sync(spec.device)
        step_ms = (time.perf_counter() - start) / spec.steps * 1e3
        start = time.perf_counter()
        for s in range(spec.steps):
            step(1 + s % 2).tolist()  # host reads the tokens each step
        step_sync_ms = (time.perf_counter() - start) / spec.steps * 1e3
        decode.append({"batch": batch, "mean_context": statistics.mean(contexts), "step_ms": step_ms,
                       "step_sync_ms": step_sync_ms, "tok_s": batch / step_ms * 1e3})
        for p in seq_pages:
            pool.free(p)
        print(json.dumps(decode[-1]), flush=True)
    return decode


def round_lengths(lengths: tuple[int, ...], budget: int) -> list[int]:
    """Prompt lengths of one full prefill round, as a busy worker's chunked prefill fills it: whole
    prompts of `lengths` in turn while they fit in `budget` tokens, then the first chunk of the next
    prompt (its first tokens, which cost what a prompt of that length does) up to the budget."""
    out: list[int] = []
    for length in lengths * (budget // max(1, min(lengths)) + 1):
        if sum(out) + length > budget:
            break
        out.append(length)
    left = budget - sum(out)
    return out + [left] if left > 0 else out


def _prefill_round(runner, spec: RunnerStepsSpec, tokens, prompt_lengths: tuple[int, ...]) -> dict:
    """One extend of `round_lengths(prompt_lengths)` prompts: the median of `--repeats` timed calls
    (one untimed first)."""
    from deepseek_pd.model.runner import ExtendSeq

    pool = runner.kv_pool
    lengths = round_lengths(prompt_lengths, spec.prefill_round_tokens)
    seqs = [ExtendSeq(tokens(n), 0, pool.alloc(pool.pages_for_tokens(n))) for n in lengths]
    times = []
    for _ in range(spec.repeats + 1):
        _sync(spec.device)
        start = time.perf_counter()
        runner.extend(seqs)
        _sync(spec.device)
        times.append(time.perf_counter() - start)
    for seq in seqs:
        pool.free(seq.pages)
    ms = statistics.median(times[1:]) * 1e3
    return {"lengths": lengths, "tokens": sum(lengths), "ms": ms, "tok_s": sum(lengths) / ms * 1e3}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--cuda-graph", action="store_true")
    parser.add_argument("--backend", default="auto", help="attention and MoE backend (auto|triton|torch)")
    parser.add_argument("--num-fused-shared-experts", type=int, default=0)
    parser.add_argument("--prefill-lengths", type=_ints, default=(512, 768, 1024))
    parser.add_argument("--batches", type=_ints, default=(1, 16, 64, 128))
    parser.add_argument("--context-min", type=int, default=512)
    parser.add_argument("--context-max", type=int, default=1024)
    parser.add_argument("--decode-offset", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enable-tbo", action="store_true", help="two-batch overlap (needs no --cuda-graph)")
    parser.add_argument("--prefill-round-tokens", type=int, default=2048,
                        help="tokens of the timed prefill round (the prefill worker's chunked_prefill_size)")
    parser.add_argument("--prefill-only-len", type=int, default=0,
                        help="also time a round of prompts of this length (the prefill-only load)")
    parser.add_argument("--decode-only-context", type=int, default=0,
                        help="also time decode steps with every context at this length ...")
    parser.add_argument("--decode-only-batches", type=_ints, default=(), help="... at these batches")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    args = parser.parse_args()
    spec = RunnerStepsSpec(args.model, args.device, args.dtype, args.page_size, args.cuda_graph, args.backend,
                           args.num_fused_shared_experts, args.prefill_lengths, args.batches, args.context_min,
                           args.context_max, args.decode_offset, args.steps, args.repeats,
                           enable_tbo=args.enable_tbo, prefill_round_tokens=args.prefill_round_tokens,
                           prefill_only_len=args.prefill_only_len, decode_only_context=args.decode_only_context,
                           decode_only_batches=args.decode_only_batches)
    with open(args.out, "w") as f:
        json.dump(measure(spec), f, indent=2)


if __name__ == "__main__":
    main()
