"""Eager torch ops of one `SpeculativeDecoder` step outside its forwards, per phase: a proxy for the
CUDA kernel launches a step adds to its graph replays (on an H100, V2-Lite, batch 1, k = 2, the
decoder's step took 6.57 ms against 4.90 ms for its graph replays alone, 2026-12-07).

Every aten op the step dispatches is counted (a `TorchDispatchMode`) under the phase it runs in:

    sync_rows   the sampling batch's rows
    chain       the draft chain, outside its MTP forwards (draft ids, gathers, argmax)
    launch      the rest of `launch`: starts, the verify's input ids, its rows for the logits
    lm_head     `runner.logits` (every call: chain, verify, catch-up); eager on the GPU too
    accept      `accept_on_device`: every position's draw, the agreeing prefix, the state's advance
    catch_up    the catch-up's ids, its last-row gather, the next drafts
    host_copy   the step's one device-to-host copy and its packing
    finish      `finish` (host-side: unpack, emit)

The forwards (`runner.extend_hidden`, `runner.draft`: CUDA-graph replays on the GPU) are not
counted in the total, only apart (`forward_ops`: the whole eager model on the CPU; with
`--cuda-graph` on the GPU, the graph runners' input copies around each replay) with their calls
(`forwards`). Ops that launch no kernel (views such as `view`, `unsqueeze`,
slicing; `empty`; `detach_` of a host tensor built from a list) are reported apart (`free`); each `upload` (a host-to-device copy on the GPU, none on the CPU) counts
as one op of its phase. Two steps are counted over the same greedy rows: one launched after the
step before was read (`inorder`), one launched ahead of it (`ahead`, `launch(after=...)`), the
decoder's serving loop.

On the CPU (tests/model/speculative/test_speculative_ops.py bounds the totals):
    python bench/speculative_ops.py --tiny --batch 1 --steps 2
On the GPU, the times these ops cost: bench/speculative_steps.py (its docstring's command).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

# Ops that launch no kernel besides the views (`OpOverload.is_view`).
NO_KERNEL = frozenset({"detach", "detach_", "lift_fresh", "alias", "empty", "empty_strided"})
PHASES = ("sync_rows", "chain", "launch", "lm_head", "accept", "catch_up", "host_copy", "finish")


class PhaseOps(TorchDispatchMode):
    """Counts aten ops (those that launch no kernel apart) by the innermost phase entered (None:
    not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.free: Counter[str] = Counter()
        self.names: dict[str, Counter[str]] = {}
        self.phase: list[str | None] = [None]
        self.seconds: Counter[str] = Counter()  # wall time by phase, exclusive
        self._since = time.perf_counter()

    def _charge(self) -> None:
        now = time.perf_counter()
        phase = next((p for p in reversed(self.phase) if p is not None), None)  # None: its caller's
        if phase is not None:
            self.seconds[phase] += now - self._since
        self._since = now

    @contextlib.contextmanager
    def entered(self, phase: str | None) -> Iterator[None]:
        self._charge()
        self.phase.append(phase)
        try:
            yield
        finally:
            self._charge()
            self.phase.pop()

    def count(self, name: str, free: bool = False) -> None:
        phase = self.phase[-1]
        if phase is None:
            return
        (self.free if free else self.ops)[phase] += 1
        if not free:
            self.names.setdefault(phase, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        self.count(name, free=name in NO_KERNEL or (func.is_view and _aliases(out, args)))
        return out


def _aliases(out: Any, args: tuple) -> bool:
    """Whether a view-schema op's result shares its input's memory: `to`, `reshape` and the like
    (composite under inference mode) have a view's schema but copy when they must."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    result = out[0] if isinstance(out, (tuple, list)) and out else out
    if first is None or not isinstance(result, torch.Tensor):
        return True
    return result.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def _wrap(counter: PhaseOps, phase: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with counter.entered(phase):
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def phases(decoder: Any, counter: PhaseOps, dispatch: bool = True) -> Iterator[Counter[str]]:
    """Routes `decoder`'s steps through `counter` by phase while inside (its ops with `dispatch`, else
    only its times); yields the forward counts."""
    from deepseek_pd.model.speculative import decoder as decoder_module
    from deepseek_pd.model.speculative import future_positions

    runner, forwards = decoder.runner, Counter()
    saved_module = {m: (m.upload, getattr(m, "accept_on_device", None)) for m in (decoder_module, future_positions)}

    def forward(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            forwards[name] += 1
            with counter.entered("forwards"):
                return fn(*args, **kwargs)
        return run

    def counted_upload(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(host: torch.Tensor, device: Any) -> torch.Tensor:
            counter.count("upload")
            with counter.entered(None):
                return fn(host, device)
        return run

    def hidden_rows(fn: Callable[..., Any]) -> Callable[..., Any]:  # launch's index_select before the logits
        def run(hidden: torch.Tensor) -> torch.Tensor:
            with counter.entered("lm_head"):
                return fn(hidden)
        return run

    patched = {
        "launch": _wrap(counter, "launch", decoder.launch), "finish": _wrap(counter, "finish", decoder.finish),
        "_sync_rows": _wrap(counter, "sync_rows", decoder._sync_rows), "_chain": _wrap(counter, "chain", decoder._chain),
        "_catch_up": _wrap(counter, "catch_up", decoder._catch_up),
    }
    runner_patched = {"extend_hidden": forward("verify", runner.extend_hidden),
                      "draft": forward("draft", runner.draft), "logits": hidden_rows(runner.logits)}
    original_accept = decoder_module.accept_on_device
    original_host_copy = decoder_module.HostCopy
    for name, fn in patched.items():
        setattr(decoder, name, fn)
    for name, fn in runner_patched.items():
        setattr(runner, name, fn)
    for module, (up, _) in saved_module.items():
        module.upload = counted_upload(up)
    decoder_module.accept_on_device = _wrap(counter, "accept", original_accept)
    decoder_module.HostCopy = _wrap(counter, "host_copy", original_host_copy)
    try:
        with counter if dispatch else contextlib.nullcontext():
            yield forwards
    finally:
        for name in (*patched, ):
            delattr(decoder, name)
        for name in runner_patched:
            delattr(runner, name)
        for module, (up, _) in saved_module.items():
            module.upload = up
        decoder_module.accept_on_device = original_accept
        decoder_module.HostCopy = original_host_copy


class _Row:
    """A greedy request `context` tokens in (decoder.SpecRequest)."""

    def __init__(self, context: int, max_new: int, pages: list[int], sampling: Any) -> None:
        self.prompt_ids, self.output_ids = [0] * context, [1]
        self.max_new, self.pages, self.sampling = max_new, pages, sampling

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_new


@contextlib.contextmanager
def _greedy_rows(runner: Any, batch: int, k: int, context: int, steps: int, seed: int) -> Iterator[tuple]:
    """(decoder drafting k, `batch` greedy rows that last `steps` more steps), after one warm-up step
    (the sampling batch's rows are in place); their pages are freed on exit."""
    from deepseek_pd.model.sampling.params import SamplingParams
    from deepseek_pd.model.sampling.state import SamplingState
    from deepseek_pd.model.speculative.decoder import SpeculativeDecoder

    pool, config, device = runner.kv_pool, runner.model_config, runner.model.embed_tokens.weight.device
    decoder = SpeculativeDecoder(runner, k)
    max_new = (steps + 2) * (k + 1) + 2  # no row ends inside the steps (launched ahead: drafts stay k)
    rows = [_Row(context, max_new, pool.alloc(pool.pages_for_tokens(context + max_new)),
                 SamplingState.create(SamplingParams(temperature=0.0), (), config.vocab_size, device))
            for _ in range(batch)]
    rng = random.Random(seed)  # each row its own token
    hidden = torch.zeros(config.hidden_size, dtype=runner.model.embed_tokens.weight.dtype, device=device)
    try:
        for row in rows:
            row.output_ids[:] = [rng.randrange(config.vocab_size)]
            decoder.seed(row, row.output_ids[0], hidden)
        decoder.step(rows)
        yield decoder, rows
    finally:
        for row in rows:
            pool.free(row.pages)


def pages_needed(batch: int, k: int, context: int, steps: int, page_size: int) -> int:
    """KV pages `count_step_ops` / `time_step_phases` over `steps` steps need (+ 2 spare)."""
    return batch * -(-(context + (steps + 2) * (k + 1) + 2) // page_size) + 2


@torch.inference_mode()
def time_step_phases(runner: Any, batch: int, k: int, context: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Median wall milliseconds by phase (exclusive; "forwards": inside the forwards) of `steps`
    in-order steps, without counting ops (the counting mode's own cost stays out). On the GPU this
    is the host's time to queue each phase (nothing syncs but `finish`'s read, which waits for the step)."""
    with _greedy_rows(runner, batch, k, context, steps, seed) as (decoder, rows):
        times: dict[str, list[float]] = {}
        for _ in range(steps):
            counter = PhaseOps()
            with phases(decoder, counter, dispatch=False):
                decoder.finish(decoder.launch(rows))
            for phase in (*PHASES, "forwards"):
                times.setdefault(phase, []).append(counter.seconds[phase] * 1e3)
    return {phase: statistics.median(ms) for phase, ms in times.items()}


@torch.inference_mode()
def count_step_ops(runner: Any, batch: int, k: int, context: int, seed: int = 0) -> dict:
    """Ops per phase of one in-order and one launched-ahead step over `batch` greedy rows drafting
    `k` (after one uncounted warm-up step): {"inorder"|"ahead": {"ops": {phase: n}, "free": ...,
    "total": n, "forwards": {...}, "names": {phase: {op: n}}}}."""
    result = {}
    with _greedy_rows(runner, batch, k, context, 3, seed) as (decoder, rows):
        for name in ("inorder", "ahead"):
            counter = PhaseOps()
            if name == "inorder":
                with phases(decoder, counter) as forwards:
                    decoder.finish(decoder.launch(rows))
            else:
                first = decoder.launch(rows)
                with phases(decoder, counter) as forwards:
                    second = decoder.launch(rows, after=first)
                decoder.finish(first)
                with phases(decoder, counter):
                    decoder.finish(second)
            result[name] = {"ops": {p: counter.ops[p] for p in PHASES}, "free": {p: counter.free[p] for p in PHASES},
                            "total": sum(counter.ops[p] for p in PHASES), "forwards": dict(forwards),
                            "forward_ops": counter.ops["forwards"],
                            "names": {p: dict(counter.names.get(p, {})) for p in PHASES}}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory with an MTP layer")
    where.add_argument("--tiny", action="store_true", help="the tiny model with a random MTP layer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cuda-graph", action="store_true", help="replay the draft, verify and catch-up graphs")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="drafts per step (k)")
    parser.add_argument("--names", action="store_true", help="also list each phase's ops by name")
    parser.add_argument("--time-steps", type=int, default=0,
                        help="also time this many in-order steps by phase (wall ms, without the counting)")
    parser.add_argument("--out", help="write the counts here as JSON")
    args = parser.parse_args(argv)
    from deepseek_pd.model.runner import ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    if args.tiny:
        import tempfile

        from deepseek_pd.model.checkpoint.tiny import make_tiny_model
        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-mtp", mtp_layers=1))
    else:
        model = args.model
    num_pages = pages_needed(args.batch, args.steps, args.context, max(3, args.time_steps), args.page_size)
    runner = ModelRunner(RunnerConfig(model=model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                                      num_pages=num_pages, speculative_num_steps=args.steps,
                                      cuda_graph=args.cuda_graph))
    result = count_step_ops(runner, args.batch, args.steps, args.context)
    for name, counts in result.items():
        print(f"{name}: {counts['total']} ops (+{sum(counts['free'].values())} free), forwards {counts['forwards']} "
              f"(+{counts['forward_ops']} ops inside them)")
        for phase in PHASES:
            line = f"  {phase:<11} {counts['ops'][phase]:>4} ops {counts['free'][phase]:>4} free"
            if args.names and counts["names"][phase]:
                line += "  " + ", ".join(f"{op} {n}" for op, n in sorted(counts["names"][phase].items()))
            print(line)
    if args.time_steps:
        result["ms"] = time_step_phases(runner, args.batch, args.steps, args.context, args.time_steps)
        print("wall ms by phase (in order): " + ", ".join(f"{p} {ms:.3f}" for p, ms in result["ms"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
