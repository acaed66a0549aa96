"""What `serve` refuses from its flags alone, before it reads a checkpoint or looks at a device.

Torch-free: `resolve_serve_config` (workers/serve/resolution.py) applies it first, and the operator
applies it to each role's command line (operator/engine_args.py), so a DeepSeekDeployment whose
engineArgs a worker would refuse gets an InvalidSpec condition naming the rule, in the worker's
own words, instead of pods that crash-loop. The runner's rules come from model/runner_rules.py,
which `RunnerConfig` applies again when it is built.

The rules:
- an `--engine-opt` key no worker config has, a value not of its type, or a number out of its config's
  range (workers/serve/engine_options.py, over the key table workers/serve/engine_option_keys.py): a typo
  is refused, naming the closest key;
- `--speculative-num-steps` outside 0..8 (model/speculative/rules.py);
- a memory setting out of range (`sizing_blocker`: `--page-size`, `--mem-fraction-static`,
  `mem_headroom_gib`, `--gpu-workers`/`--kv-share`, `--ep-num-redundant-experts`, `fp8_backend`);
- `--engine-opt cuda_graph=true` on a role that never decodes (prefill): it has no graphs to capture;
- `cuda_graph=true` with settings no graph can capture (model/runner_rules.py `graph_settings_blocker`:
  `record_expert_load`, `--enable-tbo`, `--tp` > 1);
- `extend_cuda_graph=true` with settings no extend graph can capture (`extend_graph_settings_blocker`:
  `record_expert_load`, `--enable-tbo`, `--tp` or `--ep` > 1, `--deterministic`, speculative decoding);
- `--enable-tbo` with `--tp` > 1 (`tbo_blocker`);
- `--deterministic` with what is not batch-invariant yet (`deterministic_blocker`), or with
  `--engine-opt prefix_cache=true`;
- `--num-pages` and `--max-total-tokens` both (each sizes the KV pool), or either below 1;
  `--chunked-prefill-size` below 1 (`SchedulerConfig`'s own bounds);
- the runner fields the group layout decides (`ep_size`, `tp_size`, `dispatcher`, `dispatch_mode`)
  set as engine options.

Example: `check_flags(ServeFlags.from_argv(["prefill", "--engine-opt", "cuda_graph=true"]))` raises
`UserError("--engine-opt cuda_graph=true: the prefill worker never decodes, ...")`.
"""
from __future__ import annotations

from deepseek_pd.errors import UserError
from deepseek_pd.model.runner_rules import (deterministic_blocker, extend_graph_settings_blocker,
                                            graph_settings_blocker, sizing_blocker, tbo_blocker)
from deepseek_pd.model.speculative.rules import check_speculative_num_steps
from deepseek_pd.workers.engine.scheduler_config import SCHEDULER_BOUNDS
from deepseek_pd.workers.serve.engine_options import parse_engine_options
from deepseek_pd.workers.serve.flags import ServeFlags
from deepseek_pd.workers.serve.roles import role_defaults

# Runner fields the group layout decides (workers/group/layout.py), never set directly.
GROUP_RUNNER_FIELDS = ("ep_size", "tp_size", "dispatcher", "dispatch_mode")


def check_flags(flags: ServeFlags) -> None:
    """Raises a UserError naming the first rule (module docstring) that `flags` break."""
    options = parse_engine_options(flags.all_engine_options)
    for name in GROUP_RUNNER_FIELDS:
        if name in options:
            raise UserError(f"--engine-opt {name}: set by --ep/--deepep-mode (the group layout), not directly")
    check_speculative_num_steps(options.get("speculative_num_steps", 0))
    if (blocker := sizing_blocker(page_size=flags.page_size, mem_fraction_static=flags.mem_fraction_static,
                                  mem_headroom_gib=options.get("mem_headroom_gib"), gpu_workers=flags.gpu_workers,
                                  kv_share=flags.kv_share,
                                  ep_num_redundant_experts=flags.parallel.ep_num_redundant_experts,
                                  fp8_backend=options.get("fp8_backend", "auto"))) is not None:
        raise UserError(blocker)
    tp, ep = flags.parallel.tp, flags.parallel.ep
    graphs = options.get("cuda_graph")
    enable_tbo = options.get("enable_tbo", False)
    if graphs and not role_defaults(flags.role).decodes:
        raise UserError(f"--engine-opt cuda_graph=true: the {flags.role} worker never decodes, so it has no "
                        f"CUDA graphs to capture (decode workers replay them by default on CUDA)")
    if graphs and (blocker := graph_settings_blocker(record_expert_load=options.get("record_expert_load", False),
                                                     enable_tbo=enable_tbo, tp_size=tp)) is not None:
        raise UserError(f"cuda_graph=true: {blocker}")
    if options.get("extend_cuda_graph") and (blocker := extend_graph_settings_blocker(
            record_expert_load=options.get("record_expert_load", False), enable_tbo=enable_tbo, tp_size=tp,
            ep_size=ep, deterministic=options.get("deterministic", False),
            speculative_num_steps=options.get("speculative_num_steps", 0))) is not None:
        raise UserError(f"extend_cuda_graph=true: {blocker}")
    if enable_tbo and (blocker := tbo_blocker(tp)) is not None:
        raise UserError(blocker)
    if options.get("deterministic"):
        blocker = deterministic_blocker(
            enable_tbo=enable_tbo, tp_size=tp, ep_size=ep,
            speculative_num_steps=options.get("speculative_num_steps", 0),
            attention_backend=options.get("attention_backend", "auto"),
            moe_backend=options.get("moe_backend", "auto"), fp8_backend=options.get("fp8_backend", "auto"))
        if blocker is not None:
            raise UserError(f"--deterministic: {blocker}")
        if options.get("prefix_cache"):
            raise UserError("--deterministic runs without the prefix cache: drop --engine-opt prefix_cache=true")
    if flags.num_pages is not None and flags.max_total_tokens is not None:
        raise UserError("--num-pages and --max-total-tokens both size the KV pool: pass one")
    for name in ("num_pages", "max_total_tokens"):
        if getattr(flags, name) is not None and getattr(flags, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(flags, name)}")
    if flags.chunked_prefill_size is not None and (blocker := SCHEDULER_BOUNDS["chunked_prefill_size"].blocker(
            "chunked_prefill_size", flags.chunked_prefill_size)) is not None:
        raise UserError(blocker)
