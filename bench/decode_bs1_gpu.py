"""Batch-1 decode (issue 21): tok/s by CUDA-graph replay with the small-batch fusions off and on,
in one run, with each layer's kernel count, time and weight bytes, against the weight-read floor.

Our V2-Lite-shaped model with random weights (bench/cuda_graph_gpu.py `build_random_v2lite`: bf16,
Triton backends, the 2 shared experts fused), built once with `small_batch_fusions`; each variant
keeps some of the fusions (the bench takes the others off the built modules before its runner
captures its graph):
    off     the general paths: torch ops after the router GEMM, the sorted fused MoE (6 launches)
    router  only scoring, top-k, weights and shared ids in one launch (kernels/router_select.py)
    moe     only a one-token MoE in two launches, no sort (kernels/moe_single_token.py)
    kv_norm only MLA's kv_a norm inside the rope + cache-write launch (kernels/rope_cache.py)
    on      all three
Per variant: a `--context`-token prompt, then `--steps` greedy decode steps by graph replay (the
tokens are compared with the "off" variant's), timed over `--repeats` runs; one eager step under
torch.profiler gives per op of each layer its kernels and device time (bench/decode_kernel_count.py),
printed for the dense layer 0 and one MoE layer, with the per-layer means. The graph step is split
(bench/decode_step_split.py): host time of `runner.decode`, device time of the replay alone, and
the kernels and idle gaps inside the graph from a profile of a few replays. The floor is the weight
bytes one step reads (attention and dense weights, the router, the chosen experts' slices, lm_head)
at the card's HBM rate (FACTS.md; `mla_decode_gpu.CARDS`).

    python bench/decode_bs1_gpu.py --out $OUT/bs1.json             # on the GPU, ~2 min
    python bench/decode_bs1_gpu.py --tiny                          # CPU dry run (TRITON_INTERPRET=1):
                                                                   # counts only, the tiny model
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# variant -> (router_select, the one-token MoE, the kv_a norm in the rope launch)
VARIANTS = {"off": (False, False, False), "router": (True, False, False), "moe": (False, True, False),
            "kv_norm": (False, False, True), "on": (True, True, True)}


def _build(tiny: bool):
    """The model, built with the fusions on (each variant takes some off)."""
    if tiny:
        from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir
        from deepseek_pd.model.config import ModelConfig
        from deepseek_pd.model.runner import ModelRunner
        from deepseek_pd.model.runner_config import RunnerConfig

        path = str(resolve_model_dir("tiny"))
        return ModelRunner(RunnerConfig(model=path, device="cpu", dtype="float32", attention_backend="triton",
                                        moe_backend="triton", norm_rope_backend="triton", small_batch_fusions=True,
                                        num_fused_shared_experts=ModelConfig.from_hf(path).n_shared_experts)).model
    from cuda_graph_gpu import build_random_v2lite

    return build_random_v2lite(small_batch_fusions=True, norm_rope_backend="triton")


def _keep_fusions(model, router: bool, moe: bool, kv_norm: bool, saved: dict) -> None:
    """Leaves the named fusions on the built layers, the others off (the bench's switch)."""
    from deepseek_pd.model.attention.mla import MLAAttention
    from deepseek_pd.model.moe.layer import DeepseekMoE

    for module in model.modules():
        if isinstance(module, DeepseekMoE):
            select, single = saved.setdefault(id(module), (module._fused_select, module.experts._single_token))
            module._fused_select = select if router else None
            module.experts._single_token = single if moe else None
        elif isinstance(module, MLAAttention):
            module.norm_in_rope = saved.setdefault(id(module), module.norm_in_rope) and kv_norm


def hbm_rate() -> float | None:
    """This card's HBM bytes/s (FACTS.md, `mla_decode_gpu.CARDS`), None for an unlisted card."""
    from mla_decode_gpu import CARDS

    name = torch.cuda.get_device_name()
    return next((hbm for key, (_, hbm) in CARDS.items() if key in name), None)


def _floor_ms(weight_bytes: int, device: str) -> tuple[float | None, float | None]:
    if not device.startswith("cuda"):
        return None, None
    rate = hbm_rate()
    return (None, None) if rate is None else (weight_bytes / rate * 1e3, rate)


@torch.inference_mode()
def run_variant(model, name: str, args, device: str, experts_read: int) -> dict:
    from decode_kernel_count import OpScopes, layer_rows, profile_ops
    from decode_step_split import split_graph_step
    from deepseek_pd.model.runner import DecodeSeq, ExtendSeq, ModelRunner
    from deepseek_pd.model.runner_config import RunnerConfig

    cuda = device.startswith("cuda")
    context = args.context
    runner = ModelRunner.from_model(model, RunnerConfig(
        model="<random>", page_size=64, num_pages=4 + 2 * -(-(context + args.steps + 2) // 64), cuda_graph=cuda,
        cuda_graph_max_batch=1, cuda_graph_max_context=context + args.steps + 64))
    pool, vocab = runner.kv_pool, runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    pages = pool.alloc(pool.pages_for_tokens(context + args.steps + 1))
    first = int(runner.extend([ExtendSeq(prompt, 0, pages)]).argmax(-1)[0])

    def greedy() -> list[int]:
        tokens = [first]
        for step in range(args.steps):
            logits = runner.decode([DecodeSeq(tokens[-1], context + step, pages)])
            tokens.append(int(logits.argmax(-1)[0]))
        return tokens

    tokens = greedy()
    # The first decode step's logits (the same input in every variant): how far a fusion moves them.
    first_logits = runner.decode([DecodeSeq(first, context, pages)]).float().cpu()
    row: dict = {"variant": name, "tokens": tokens, "_first_logits": first_logits}
    if cuda:
        # Teacher-forced replays with no host read per step: the step's device time.
        def replay():
            for step in range(args.steps):
                runner.decode([DecodeSeq(tokens[step], context + step, pages)])
        times = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / args.steps)
        row["graph_step_ms"] = statistics.median(times[1:]) * 1e3
        row["graph_tok_s"] = 1e3 / row["graph_step_ms"]
        row["split"] = split_graph_step(
            runner, lambda step: runner.decode([DecodeSeq(tokens[step], context + step, pages)]), 1, args.steps)
    scopes = OpScopes(model, experts_read)
    eager = lambda: runner.decode_eager([DecodeSeq(tokens[0], context, pages)])  # noqa: E731
    eager()  # compiled and warm before the profile
    profile_ops(scopes, eager)
    row["step_kernels"], row["step_kernel_us"] = scopes.step_kernels, round(scopes.step_kernel_us, 1)
    row["linked_kernels"], row["linked_kernel_us"] = scopes.linked_kernels, round(scopes.linked_kernel_us, 1)
    layers = layer_rows(scopes)
    row["head"] = {"launches": scopes.counts["head"].launches, "weight_bytes": scopes.counts["head"].weight_bytes}
    row["weight_bytes"] = sum(c.weight_bytes for c in scopes.counts.values())
    row["floor_ms"], row["hbm_bytes_s"] = _floor_ms(row["weight_bytes"], device)
    if row["floor_ms"] and "graph_step_ms" in row:
        row["floor_over_step"] = row["floor_ms"] / row["graph_step_ms"]
    dense = [i for i in layers if not model.layers[i].is_moe]
    moe = [i for i in layers if model.layers[i].is_moe]
    for kind, ids in (("dense", dense), ("moe", moe)):
        if ids:
            row[f"{kind}_layer_mean"] = {key: statistics.mean(layers[i][key] for i in ids)
                                         for key in ("launches", "kernels", "kernel_us", "weight_bytes")}
            row[f"{kind}_layer_example"] = {"layer": ids[len(ids) // 2], **layers[ids[len(ids) // 2]]}
    pool.free(pages)
    return row


def _print(row: dict) -> None:
    head = f"[{row['variant']}]"
    if "graph_step_ms" in row:
        floor = f", floor {row['floor_ms']:.3f} ms ({row['floor_over_step']:.2f} of the step)" if row.get(
            "floor_ms") else ""
        print(f"{head} graph step {row['graph_step_ms']:.3f} ms = {row['graph_tok_s']:.0f} tok/s{floor}; "
              f"eager step: {row['step_kernels']} kernels, {row['step_kernel_us'] / 1e3:.3f} ms of kernel time "
              f"({row['linked_kernels']} linked to a launch, {row['linked_kernel_us'] / 1e3:.3f} ms: the per-op rows)")
    if "split" in row:
        from decode_step_split import print_split

        print_split(head, row["split"], row.get("graph_step_ms"))
    print(f"{head} weights read per step {row['weight_bytes'] / 1e9:.3f} GB; outside the layers "
          f"{row['head']['launches']} launches")
    for kind in ("dense", "moe"):
        if f"{kind}_layer_mean" in row:
            mean, ex = row[f"{kind}_layer_mean"], row[f"{kind}_layer_example"]
            print(f"{head} {kind} layer mean: {mean['launches']:.1f} launches, {mean['kernels']:.1f} kernels, "
                  f"{mean['kernel_us']:.1f} us, {mean['weight_bytes'] / 1e6:.2f} MB of weights")
            for op, c in ex["ops"].items():
                print(f"    L{ex['layer']}.{op:<15} launches {c['launches']:>3}  kernels {c['kernels']:>3}  "
                      f"{c['kernel_us']:>8.1f} us  {c['weight_bytes'] / 1e6:>9.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (Triton's interpreter)")
    parser.add_argument("--variants", default="off,router,moe,kv_norm,on")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.context, args.steps = min(args.context, 9), min(args.steps, 2)
    device = "cpu" if args.tiny else "cuda"
    start = time.perf_counter()
    model = _build(args.tiny)
    config = model.config
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                    "build_s": round(time.perf_counter() - start, 1), "variants": []}
    # One token reads its k routed experts (and every fused shared one: OpScopes adds those).
    experts_read = config.num_experts_per_tok
    saved: dict = {}
    for name in args.variants.split(","):
        _keep_fusions(model, *VARIANTS[name], saved)
        row = run_variant(model, name, args, device, experts_read)
        if device == "cuda":
            torch.cuda.empty_cache()  # the variant's runner (KV pages, graph pool) is gone
        base = result["variants"][0] if result["variants"] else row
        row["tokens_equal_first_variant"] = row["tokens"] == base["tokens"]
        row["tokens_agreeing_first_variant"] = next(
            (i for i, (a, b) in enumerate(zip(row["tokens"], base["tokens"])) if a != b), len(row["tokens"]))
        want = base["_first_logits"].double()
        row["first_logits_rel_err"] = float((row["_first_logits"].double() - want).norm() / want.norm())
        row["first_logits_max_abs"] = float((row["_first_logits"].double() - want).abs().max())
        if "graph_tok_s" in base and "graph_tok_s" in row:
            row["speedup_over_first"] = row["graph_tok_s"] / base["graph_tok_s"]
        result["variants"].append(row)
        _print(row)
        print(f"[{name}] first step's logits vs [{base['variant']}]: rel err {row['first_logits_rel_err']:.2e}, "
              f"max abs {row['first_logits_max_abs']:.2e}; greedy tokens agree for "
              f"{row['tokens_agreeing_first_variant']} of {len(row['tokens'])}")
        print(f"[{name}] greedy tokens equal to [{base['variant']}]: {row['tokens_equal_first_variant']}"
              + (f"; speed-up {row['speedup_over_first']:.2f}x" if "speedup_over_first" in row else ""), flush=True)
    for row in result["variants"]:
        del row["_first_logits"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
