"""The "torch" MoE kernel on the CPU: expert counts on the device (`_grouped_mm`) against its loop
over host counts (`bincount().tolist()`, what it ran before), at decode and prefill batch sizes.

    .venv/bin/python bench/moe_host_counts.py             # tiny-model and V2-Lite-like shapes, one thread

The two run alternately (so that load on a shared machine falls on both); printed: the best and
median of `--repeats` per batch size, the ratio of the bests, and whether the outputs are equal
bit for bit (they must be; the exit status says).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from deepseek_pd.model.moe.experts import TorchMoEKernel

SHAPES = {"tiny": (9, 3, 64, 32, (1, 4, 16, 64, 512)),  # 8 routed + 1 fused shared expert, k = 2 + 1
          "v2-lite": (66, 8, 2048, 1408, (1, 4, 16))}  # 64 routed + 2 fused shared, k = 6 + 2


class HostCounts(TorchMoEKernel):
    def _groups_on_device(self, hidden, w2) -> bool:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,v2-lite")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device, host = TorchMoEKernel(), HostCounts()
    equal = True
    for name in args.shapes.split(","):
        experts, k, hidden_size, inter, batches = SHAPES[name]
        w13 = torch.randn(experts, 2 * inter, hidden_size) * 0.02
        w2 = torch.randn(experts, hidden_size, inter) * 0.02
        for tokens in batches:
            x = torch.randn(tokens, hidden_size)
            ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k)
            times: dict[str, list[float]] = {"host": [], "device": []}
            for _ in range(args.repeats):
                for label, kernel in (("host", host), ("device", device)):
                    began = time.perf_counter()
                    out = kernel(x, ids, weights, w13, w2)
                    times[label].append(time.perf_counter() - began)
                    equal &= torch.equal(out, host(x, ids, weights, w13, w2)) if label == "device" else True
            (a, b) = (sorted(times["host"]), sorted(times["device"]))
            print(f"{name} N={tokens}: host counts best {a[0] * 1e3:.2f} ms (median {a[len(a) // 2] * 1e3:.2f}), "
                  f"device counts best {b[0] * 1e3:.2f} ms (median {b[len(b) // 2] * 1e3:.2f}); ratio {b[0] / a[0]:.2f}")
    print("bit for bit:", equal)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
