"""The two runner configs the serving benchmark holds against each other, built in one place.

`bench/serving_gpu.py` starts its prefill worker with `worker_flags(plan)` and measures the runner
alone with `bench/runner_steps.py`; a bench that compares the worker's forward with the runner's
(prefill_step_ratio.py, prefill_host_overhead.py, gil_switch.py) must build the very configs those
two build, or it measures another model (before 2026-12-07 prefill_step_ratio.py built its runner
with the "auto" backends and unfused shared experts, where both of those run Triton with the
shared experts fused):

    worker = worker_runner_config(Path("/tmp/v2lite"), "cuda", num_pages=64)  # `serve prefill`'s
    runner = runner_bench_config(Path("/tmp/v2lite"), "cuda", num_pages=64)   # runner_steps.py's
    config_differences(runner, worker, model_config)  # {} when the forwards are the same
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from deepseek_pd import env
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.runner_config import RunnerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings: serving_gpu.py, runner_steps.py

# RunnerConfig fields that size the pool or decode's graphs: they change no extend.
POOL_FIELDS = frozenset({"num_pages", "mem_fraction_static", "gpu_workers", "kv_share", "mem_headroom_gib",
                         "mem_reserve_bytes", "cuda_graph", "cuda_graph_max_batch", "cuda_graph_max_context"})
# RunnerConfig fields that change an extend beyond its build options.
FORWARD_FIELDS = frozenset({"attention_method", "mha_chunked_kv_threshold", "prefix_chunk_size",
                            "record_expert_load"})


def serving_plan(device: str):
    """bench/serving_gpu.py's plan for `device`: GPU on CUDA, its tiny CPU plan elsewhere."""
    import serving_gpu
    return serving_gpu.GPU if device.startswith("cuda") else serving_gpu.TINY


def worker_runner_config(directory: Path, device: str, num_pages: int) -> RunnerConfig:
    """The RunnerConfig `serve prefill` resolves from the serving benchmark's worker flags (its pool:
    `num_pages`)."""
    import serving_gpu
    from deepseek_pd.cli import build_parser
    from deepseek_pd.commands.serve import flags_from_args
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    extra = [f"--engine-opt=num_fused_shared_experts={fused_shared_experts(directory)}"]  # later flags win
    flags = [flag for flag in serving_gpu.worker_flags(serving_plan(device), extra) if not flag.startswith("--num-pages")]
    argv = ["serve", "prefill", "--model", str(directory), *flags, f"--num-pages={num_pages}"]
    if env.internal_secret_file() is None:  # authentication changes no forward (`up` hands its workers a secret)
        argv.append("--insecure-internal")
    return resolve_serve_config(flags_from_args(build_parser().parse_args(argv))).runner


def runner_bench_config(directory: Path, device: str, num_pages: int) -> RunnerConfig:
    """The RunnerConfig bench/runner_steps.py builds for the serving benchmark's runner figures,
    as serving_gpu.py calls it (its pool: `num_pages`; no CUDA graphs: they change no extend)."""
    import runner_steps
    plan = serving_plan(device)
    spec = runner_steps.RunnerStepsSpec(model=str(directory), device=device, dtype=plan.dtype,
                                        page_size=plan.page_size, cuda_graph=False, backend=plan.backend,
                                        num_fused_shared_experts=fused_shared_experts(directory))
    return dataclasses.replace(runner_steps.runner_config(spec), num_pages=num_pages)


def fused_shared_experts(directory: Path) -> int:
    """What serving_gpu.py fuses: every shared expert of its model (`FUSED_SHARED_EXPERTS`: V2-Lite's
    two), so a bench may apply the rule to another model (the tiny one has one)."""
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

    return ModelConfig.from_hf(resolve_model_dir(str(directory)) / "config.json").n_shared_experts


def config_differences(bench: RunnerConfig, worker: RunnerConfig, model_config: ModelConfig) -> dict[str, list[str]]:
    """{field: [bench's, worker's]} where the two differ, pool sizing left out; the resolved build
    options as `build_options.<field>`."""
    from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir

    diff = {f.name: [getattr(bench, f.name), getattr(worker, f.name)] for f in dataclasses.fields(RunnerConfig)
            if f.name not in POOL_FIELDS and getattr(bench, f.name) != getattr(worker, f.name)}
    if "model" in diff and len({resolve_model_dir(name).resolve() for name in diff["model"]}) == 1:
        del diff["model"]  # "tiny" and the directory it names
    built = [config.build_options(model_config) for config in (bench, worker)]
    for f in dataclasses.fields(built[0]):
        ours, theirs = (getattr(options, f.name) for options in built)
        if ours != theirs:
            diff[f"build_options.{f.name}"] = [ours, theirs]
    return {name: [repr(a), repr(b)] for name, (a, b) in diff.items()}


def forwards_differ(diff: dict[str, list[str]]) -> bool:
    """Whether `config_differences` names anything an extend would do differently."""
    return any(name.startswith("build_options.") or name in FORWARD_FIELDS for name in diff)
