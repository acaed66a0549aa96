"""One token's MoE at V2-Lite's shape (issue 21): the single-token kernel's tiles against the sorted
path (`fused_moe`), device time and weight bandwidth, in one run.

Experts as `FusedExperts` holds them with the 2 shared experts fused (64 + 2, H 2048, I 1408,
bf16); each call draws 6 distinct routed ids plus the 2 shared ones, from a pool of id sets that
rotates so no call finds the last one's experts in L2. Each variant is timed over a CUDA graph of
`--calls` calls (launch gaps as in the decode graph), median of `--repeats`; the rate is the
weight bytes one call reads (8 experts' w13 and w2 slices) over that time, against the card's HBM
rate (`decode_bs1_gpu.hbm_rate`). Every variant's output is checked against the sorted path's
(relative error, bf16).

    python bench/decode_bs1_moe_tiles.py --out $OUT/moe_tiles.json    # on the GPU, ~20 s
    python bench/decode_bs1_moe_tiles.py --tiny                       # CPU (TRITON_INTERPRET=1): a small
                                                                      # shape, the outputs only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> SingleTokenTile fields; "12-07 grid": the grids and tiles of the kernel as the 2026-12-07
# bench ran it (352 and 256 programs; its K loops did not yet ask for pipelining, these do).
TILES = {
    "12-07 grid": dict(programs_per_sm=2, min_block_n_gate_up=8, min_block_n_down=8, block_k_gate_up=128,
                       tile_elements_down=8192, num_warps_down=8),
    "default": {},
    "8/sm": dict(programs_per_sm=8),
    "2/sm": dict(programs_per_sm=2),
    "k128": dict(block_k_gate_up=128, tile_elements_down=4096),
    "8 warps": dict(num_warps=8, num_warps_down=8, tile_elements_down=16384),
    "stages 1": dict(num_stages=1),
    "stages 4": dict(num_stages=4),
}


def _time_ms(call, calls: int, repeats: int, cuda: bool) -> float | None:
    if not cuda:
        call(0)
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / calls)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU (Triton's interpreter)")
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from deepseek_pd.model.kernels.fused_moe import fused_moe
    from deepseek_pd.model.kernels.moe_single_token import SingleTokenTile, fused_moe_single_token, plan_launch

    cuda = not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    routed, shared, top_k, hidden, inter = (64, 2, 6, 2048, 1408) if cuda else (8, 1, 2, 64, 48)
    gen = torch.Generator(device).manual_seed(args.seed)
    experts = routed + shared
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) / inter ** 0.5
    x = torch.randn(1, hidden, device=device, dtype=dtype, generator=gen)
    pool = 16
    ids = torch.stack([torch.cat([torch.randperm(routed, device=device, generator=gen)[:top_k],
                                  torch.arange(routed, experts, device=device)]) for _ in range(pool)])[:, None]
    weights = torch.rand(pool, 1, top_k + shared, device=device, generator=gen)
    weights[..., top_k:] = 1.0
    read = (top_k + shared) * (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rate = None
    if cuda:
        from decode_bs1_gpu import hbm_rate

        rate = hbm_rate()
    want = fused_moe(x, ids[0], weights[0], w13, w2).float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    rows = []
    variants = [("sorted fused_moe", lambda i: fused_moe(x, ids[i % pool], weights[i % pool], w13, w2), None)]
    for name, fields in TILES.items():
        tile = SingleTokenTile(**fields)
        variants.append((name, lambda i, t=tile: fused_moe_single_token(x, ids[i % pool], weights[i % pool], w13,
                                                                        w2, t), tile))
    for name, call, tile in variants:
        got = call(0).float()
        err = float((got - want).norm() / want.norm())
        ms = _time_ms(call, args.calls, args.repeats, cuda)
        row = {"variant": name, "rel_err_vs_sorted": err, "us": None if ms is None else ms * 1e3}
        if tile is not None:
            row["tile"], row["programs"] = tile.__dict__, plan_launch(1, top_k + shared, hidden, inter, sms,
                                                                        tile).programs
        if ms:
            row["gb_s"] = read / ms / 1e6
            row["of_hbm"] = row["gb_s"] * 1e9 / rate if rate else None
        rows.append(row)
        timing = "" if ms is None else f"{ms * 1e3:8.1f} us  {row['gb_s']:7.0f} GB/s" + (
            f" ({row['of_hbm']:.0%} of HBM)" if row.get("of_hbm") else "")
        print(f"[moe tiles] {name:<18}{timing}  programs {row.get('programs', '-')}  rel err {err:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "read_bytes": read,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
