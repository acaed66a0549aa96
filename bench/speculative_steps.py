"""Cost of one speculative decode step (MTP draft chain + one verify forward + MTP catch-up) against
a plain decode step, at each batch size and number of draft steps, and the speed-up that implies
at given accept lengths: `speedup(A) = A * t_plain / t_spec(k)`. The speculative step is timed by
`model.speculative.measure_step_costs`, the table the decode worker's per-step policy uses (its
catch-up at k + 1 tokens per sequence, its largest, so the estimate is conservative); the plain
step is `runner.decode` (CUDA-graph replay with `--cuda-graph`, which also replays the draft steps,
the verify and the catch-up: model/speculative/graphs.py). `spec{k}_step_ms` times the decoder's
whole step as serving runs it (`SpeculativeDecoder.step`: the forwards plus the device-side
acceptance, the catch-up's gathers and the step's one host read), greedy rows drafting k each.
`spec{k}_inorder_ms` and `spec{k}_ahead_ms` are the time per step of `--chain` consecutive steps,
each launched after the step before it was read, or before (`launch(after=...)`: positions and KV
slots from the device, model/speculative/future_positions.py), so the second hides the launch's
host work behind the device's; `spec{k}_ahead_gain` is their ratio.

On the GPU (V2-Lite shape with one random MTP layer; random weights accept nothing, so the
speed-up is the implied one):
    python bench/speculative_steps.py --write-v2-lite /tmp/v2lite-mtp --device cuda --dtype bfloat16 \\
        --cuda-graph --batches 1,8,32,128 --steps 1,2,3 --chain 16 --out spec.json
On the CPU, as a smoke run (tests/bench/test_speculative_steps_script.py runs it):
    python bench/speculative_steps.py --tiny --device cpu --dtype float32 --page-size 16 --context 30 \
        --batches 1,5 --steps 1,2 --repeats 2 --out s.json
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from speculative_floor import floor_rows, step_bytes  # noqa: E402

ACCEPT_LENGTHS = (1.8, 2.4, 3.0)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _row_tokens(batch: int, vocab_size: int) -> list[int]:
    """Each row's own token, the same in every timing of a batch: one token shared by every row
    would route them all to the same experts, and plain decode's rows differ."""
    rng = random.Random(batch)
    return [rng.randrange(vocab_size) for _ in range(batch)]


class _Row:
    """A greedy request `context` tokens in, drafting k this step (decoder.SpecRequest)."""

    def __init__(self, context: int, max_new: int, pages: list[int], sampling) -> None:
        self.prompt_ids, self.output_ids = [0] * context, [1]
        self.max_new, self.pages, self.sampling = max_new, pages, sampling

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


def _decoder_step_ms(runner, batch: int, k: int, context: int, repeats: int, device: str) -> float:
    """Median milliseconds of one whole `SpeculativeDecoder.step` over `batch` rows at `context`,
    each drafting k (every step starts from the same state: the rows' outputs and drafts reset)."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.sampling.state import SamplingState
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder

    pool, config = runner.kv_pool, runner.model_config
    hidden = torch.zeros(config.hidden_size, dtype=runner.model.embed_tokens.weight.dtype, device=device)
    decoder = SpeculativeDecoder(runner, k)
    greedy = SamplingParams(temperature=0.0)
    rows = [_Row(context, k + 2, pool.alloc(pool.pages_for_tokens(context + k + 1)),
                 SamplingState.create(greedy, (), config.vocab_size, device)) for _ in range(batch)]
    seeds = _row_tokens(batch, config.vocab_size)

    def one_step() -> None:
        for row, token in zip(rows, seeds):
            row.output_ids[:] = [token]
            decoder.seed(row, token, hidden)
        decoder.step(rows)

    try:
        return _timed(one_step, device, repeats)
    finally:
        for row in rows:
            pool.free(row.pages)


def _chained_step_ms(runner, batch: int, k: int, context: int, chain: int, ahead: bool, repeats: int,
                     device: str) -> tuple[float, float]:
    """Median milliseconds per step of `chain` consecutive decoder steps over `batch` greedy rows
    drafting k (random weights: each emits 1..k+1 tokens a step), each step launched after the one
    before it was read, or with `ahead` before it where the decoder allows it
    (`SpeculativeDecoder.run`); and the fraction of steps after the first that were launched ahead
    (0 where the attention backend needs host lengths)."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.sampling.state import SamplingState
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder

    pool, config = runner.kv_pool, runner.model_config
    hidden = torch.zeros(config.hidden_size, dtype=runner.model.embed_tokens.weight.dtype, device=device)
    greedy = SamplingParams(temperature=0.0)
    max_new = chain * (k + 1) + 2  # no row ends inside the chain

    def run() -> tuple[float, float]:
        decoder = SpeculativeDecoder(runner, k)
        rows = [_Row(context, max_new, pool.alloc(pool.pages_for_tokens(context + max_new)),
                     SamplingState.create(greedy, (), config.vocab_size, device)) for _ in range(batch)]
        try:
            for row, token in zip(rows, _row_tokens(batch, config.vocab_size)):
                row.output_ids[:] = [token]
                decoder.seed(row, token, hidden)
            _sync(device)
            start = time.perf_counter()
            launched = decoder.run(rows, ahead, max_steps=chain)
            _sync(device)
            return (time.perf_counter() - start) * 1e3 / chain, launched.launched_ahead / max(1, chain - 1)
        finally:
            for row in rows:
                pool.free(row.pages)

    run()  # warm-up
    runs = [run() for _ in range(repeats)]
    return statistics.median(ms for ms, _ in runs), min(ahead for _, ahead in runs)


@torch.inference_mode()
def measure(model: str, device: str, dtype: str, page_size: int, cuda_graph: bool, batches: list[int],
            draft_steps: list[int], context: int, repeats: int, chain: int = 16) -> dict:
    from deepseek_pd.model.runner import DecodeSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.model.speculative.step_costs import measure_step_costs

    max_steps = max(draft_steps)
    # Each sequence holds whole pages (measure_step_costs: context + max_steps + 1 tokens; a chain
    # of steps: context + chain * (k + 1) + 2), plus the graphs' scratch page and one spare.
    longest = max(context + max_steps + 1, context + chain * (max_steps + 1) + 2)
    num_pages = max(batches) * -(-longest // page_size) + 2

    def build(steps: int) -> ModelRunner:
        return ModelRunner(RunnerConfig(model=model, device=device, dtype=dtype, page_size=page_size,
                                        cuda_graph=cuda_graph, num_pages=num_pages, speculative_num_steps=steps))

    def plain_ms(runner: ModelRunner) -> list[float]:
        times = []
        for batch in batches:
            pool = runner.kv_pool
            pages = [pool.alloc(pool.pages_for_tokens(context + 1)) for _ in range(batch)]
            try:
                tokens = _row_tokens(batch, runner.model_config.vocab_size)
                times.append(_timed(lambda: runner.decode([DecodeSeq(t, context, p) for t, p in zip(tokens, pages)]),
                                    device, repeats))
            finally:
                for p in pages:
                    pool.free(p)
        return times

    # The speculative step, as the decode worker's policy measures it (model/speculative/decoder.py).
    # With graphs the verify and catch-up are captured for the configured k + 1 tokens per sequence
    # only, so each k gets a runner configured with it, built after the last one is freed (two
    # V2-Lite copies do not fit an 80 GB card); eager, one runner times every k.
    step_ms: dict[int, list[float]] = {}
    spec_ms: dict[int, list[float]] = {}
    plain: list[float] = []
    chained: dict[tuple[int, bool], list[float]] = {}
    floors: list[dict] = []
    for k in (draft_steps if cuda_graph else [max_steps]):
        runner = build(k)
        if not floors:  # the weight-read bound (bench/speculative_floor.py): from the built model
            config = runner.model_config
            floors = floor_rows(step_bytes(runner.model, config.n_routed_experts, config.num_experts_per_tok),
                                batches, draft_steps, ACCEPT_LENGTHS)
        costs = measure_step_costs(runner, batches, k, context, repeats).ms
        for timed in (draft_steps if not cuda_graph else [k]):
            spec_ms[timed] = costs[timed]
            step_ms[timed] = [_decoder_step_ms(runner, b, timed, context, repeats, device) for b in batches]
            for ahead in (False, True):
                chained[timed, ahead] = [_chained_step_ms(runner, b, timed, context, chain, ahead, repeats, device)
                                         for b in batches]
        if not plain:
            plain = plain_ms(runner)
        del runner
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows = []
    for col, batch in enumerate(batches):
        row = {"batch": batch, "plain_ms": plain[col], "floor": floors[col]}
        for k in draft_steps:
            cost = spec_ms[k][col]
            row[f"spec{k}_ms"] = cost
            row[f"spec{k}_step_ms"] = step_ms[k][col]
            row[f"spec{k}_inorder_ms"] = chained[k, False][col][0]
            row[f"spec{k}_ahead_ms"], row[f"spec{k}_ahead_launched"] = chained[k, True][col]
            row[f"spec{k}_ahead_gain"] = chained[k, False][col][0] / chained[k, True][col][0]
            for a in ACCEPT_LENGTHS:
                if a <= k + 1:
                    row[f"spec{k}_speedup_at_{a}"] = a * plain[col] / cost
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": model, "device": device, "dtype": dtype, "cuda_graph": cuda_graph, "context": context,
            "chain": chain, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory with an MTP layer")
    where.add_argument("--write-v2-lite", metavar="DIR",
                       help="write (once) a random V2-Lite checkpoint with one MTP layer")
    where.add_argument("--tiny", action="store_true", help="the tiny model with a random MTP layer (CPU smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="CUDA-graph replay: plain decode, and the speculative draft, verify and catch-up")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--steps", default="1,2,3", help="draft steps to time")
    parser.add_argument("--context", type=int, default=1024, help="tokens already cached per sequence")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chain", type=int, default=16,
                        help="consecutive steps per timing of the in-order and launched-ahead loops")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.tiny:
        import tempfile

        from deepseek_pd.model.checkpoint.tiny import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-mtp", mtp_layers=1))
    elif args.write_v2_lite:
        from random_checkpoint import ensure_random_checkpoint, v2_lite_config
        model = args.write_v2_lite
        ensure_random_checkpoint(model, v2_lite_config(num_nextn_predict_layers=1), device=args.device)
    else:
        model = args.model
    result = measure(model, args.device, args.dtype, args.page_size, args.cuda_graph,
                     [int(b) for b in args.batches.split(",")], [int(k) for k in args.steps.split(",")],
                     args.context, args.repeats, args.chain)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
