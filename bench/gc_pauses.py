"""What a full garbage collection costs a worker, and what freezing its startup heap leaves.

A worker's heap after start is dominated by objects that live as long as it: the model's modules
and parameters, the imported libraries. This builds the model of `--shape` on the meta device (the
same module tree as a loaded worker, without the weights' memory), imports the worker stack, and
times a full collection (`gc.collect()`) `--repeats` times before and after
`workers/metrics/gc_pauses.freeze_startup_heap()`, in one process:

    python bench/gc_pauses.py --shape v2-lite --out gc.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _full_collections(repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - began)
    return {"median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3,
            "tracked_objects": len(gc.get_objects())}


def measure(shape: str, repeats: int) -> dict:
    import torch

    import deepseek_pd.workers.serve.builders  # noqa: F401  (the worker stack's imports)
    import deepseek_pd.workers.serve.group_main  # noqa: F401
    from deepseek_pd.model.build_options import BuildOptions
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.deepseek import DeepseekForCausalLM
    from deepseek_pd.workers.metrics.gc_pauses import freeze_startup_heap
    from random_checkpoint import V2_MINI, v2_lite_config

    config = ModelConfig.from_hf({**(v2_lite_config() if shape == "v2-lite" else V2_MINI), "vocab_size": 32000})
    model = DeepseekForCausalLM(config, BuildOptions(device="meta", dtype=torch.bfloat16))
    before = _full_collections(repeats)
    frozen = freeze_startup_heap()
    after = _full_collections(repeats)
    gc.unfreeze()
    del model
    return {"shape": shape, "python": sys.version.split()[0], "frozen_objects": frozen,
            "before_freeze": before, "after_freeze": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["v2-lite", "v2-mini"], default="v2-lite")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    result = measure(args.shape, args.repeats)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
