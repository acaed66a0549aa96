"""`deepseek-pd serve` flags -> one frozen `ServeConfig`, every default and "auto" decided here.

The rules, each in one place:
- what the flags alone break (a prefill worker asked for CUDA graphs, `--enable-tbo` with `--tp` > 1,
  both pool sizes, ...): workers/serve/flag_rules.py, checked first; the operator checks a CR's
  engineArgs by the same function.
- device: `--device auto` is CUDA when available, else the CPU (`model.device.resolve_device`).
- dtype: `--dtype auto` is the checkpoint's torch_dtype on CUDA (bf16 for FP8 checkpoints), fp32
  on the CPU (`model.runner_config.auto_dtype`).
- CUDA graphs: on for a decode worker on CUDA with capturable backends, never for prefill
  (workers/serve/roles.py); `--engine-opt cuda_graph=false` turns them off. The largest captured batch
  (`cuda_graph_max_batch`) follows the decode batch cap (`max_running_requests`) unless set: a batch
  above the largest graph runs eagerly, 4.9x a graph step at batch 256 on the H200 (60.4 against
  12.4 ms at 128, docs/performance.md), as SGLang sizes `cuda_graph_max_bs` from its running cap.
- KV pool: `--num-pages` or `--max-total-tokens` fix its size; otherwise on CUDA it is sized from
  `--mem-fraction-static` (default 0.88) of the GPU's memory after the weights load, on a GPU shared
  by `--gpu-workers` workers `--kv-share` of the room their weights leave (model/kv/memory_budget.py,
  model/kv/pool_sizing.py); on the CPU it keeps the fixed default of 1024 pages. A worker that
  allocates a Mooncake staging area (decode; prefill over RDMA) keeps its bytes out of a pool sized
  so (`RunnerConfig.mem_reserve_bytes`, workers/serve/kv_staging.py, the operator's rule too).
- page size: `--page-size`, else 64 where FlashMLA's decode can run and 16 elsewhere, the same for
  both roles (model/kv/page_size.py says why), decided before the pool is sized.
- identity: what GetServerInfo/GetLoads report, with the runner's page size and its KV pool's bytes
  per token in the resolved dtype (`model.kv_pool.bytes_per_pool_page`, the pool's own rule).
- chunked prefill: `--chunked-prefill-size` (it has no engine option); unset, 2048 on
  the CPU and on a GPU by its total memory as SGLang (8192 on an H200; `gpu_chunked_prefill_size`, the
  memory read through NVML, `model/nvml.py`, so no CUDA context is made here).
- layer-wise KV transfer (prefill): `SchedulerConfig.layerwise_transfer`, on by default (correct on every
  path: plain, TBO, any transport; direct same-host copies send per chunk regardless, see
  `SendChannel.streams_layers`); `--engine-opt layerwise_transfer=false` sends per chunk instead.
- KV protocol: `--kv-protocol rdma` (with `--kv-devices`, `--kv-tcp-fallback`) is checked against
  the RDMA devices this container can use (kv_transfer/rdma_devices.py) and lands in
  `TransportConfig.mooncake_protocol/mooncake_device`; it only applies to `--kv-transport mooncake`.
  The devices are split over the node's local ranks (`devices_per_local_rank`: with 8 ranks and 8
  HCAs one each) into `TransportConfig.mooncake_rank_devices`; each rank takes its own share
  (`TransportConfig.for_local_rank`, workers/serve/group_main.py).
- the group (workers/group/layout.py): `--tp/--dp/--ep/--nnodes/--node-rank/--dist-init-addr`
  become one `GroupLayout`; the runner's `ep_size`, `tp_size` (attention TP: `--tp`) and dispatcher
  follow from it (`all_to_all`, or `deepep` where `deep_ep` imports and `--deepep-mode` is not none),
  and so does the runner's `dispatch_mode` (`GroupLayout.dispatch_mode`: the layout per step); the
  low-latency capacity `low_latency_max_tokens` is sized from (or checked against) the largest
  step that runs in that layout (`size_low_latency_capacity`);
  CUDA graphs are off where the dispatcher cannot be captured and under attention TP
  (RunnerConfig.resolve; `cuda_graph=true` with `--tp` > 1 is refused, so is `enable_tbo`), and
  `--tp` must divide the model's attention heads.
- engine options: the `--engine-opt` items and the flags that spell one (the contract's kind
  `engine_option`, `ServeFlags.all_engine_options`) set config fields by name, the keys and their
  types from one torch-free table (workers/serve/engine_option_keys.py, workers/serve/engine_options.py);
  `deterministic` sets the runner's and the scheduler's, and with
  it the prefix cache is off.
- EPLB: `--ep-num-redundant-experts` and `--init-expert-location` become the runner's fields; the
  placement file is read and checked against the model and `--ep` here, before any rank starts
  (model/eplb/expert_location.py).
"""
from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path
from typing import Any

from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.device import is_cuda, resolve_device
from deepseek_pd.model.distributed.dispatch_mode import DispatchMode
from deepseek_pd.model.forward_batch import ForwardMode
from deepseek_pd.model.kv.pool import bytes_per_pool_page
from deepseek_pd.model.speculative.mtp_names import kv_layers
from deepseek_pd.model.checkpoint.model_dir import resolve_model_dir, served_name
from deepseek_pd.model.nvml import total_memory_bytes
from deepseek_pd.model.runner_config import RunnerConfig, default_page_size
from deepseek_pd.units import gib
from deepseek_pd.workers.transport.internal_auth import resolve_auth
from deepseek_pd.workers.group.layout import GroupLayout
from deepseek_pd.workers.transport.base import TransportConfig
from deepseek_pd.workers.transport.rdma_devices import (
    KVProtocolChoice, choose_kv_protocol, devices_per_local_rank, parse_devices, usable_rdma_devices)
from deepseek_pd.workers.metrics.server import MetricsConfig
from deepseek_pd.workers.serve.config import ServeConfig
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.api.served_model import ServedModelInfo
from deepseek_pd.workers.api.server import ServerConfig
from deepseek_pd.workers.api.servicer import WorkerIdentity
from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig, gpu_chunked_prefill_size
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.transport.worker_config import WorkerConfig
from deepseek_pd.workers.serve.engine_options import assign_engine_options, parse_engine_options
from deepseek_pd.workers.serve.kv_staging import staging_reserve_bytes
from deepseek_pd.workers.serve.roles import RoleDefaults, role_defaults
from deepseek_pd.workers.serve.flags import ParallelFlags, ServeFlags

log = logging.getLogger(__name__)

# Config fields that have their own `serve` flags (or, warn_exposure and mem_reserve_bytes, that serve
# sets itself), and so are not engine options: every other field is a key of
# workers/serve/engine_option_keys.py (tests/workers/test_engine_option_keys.py keeps them so).
_FLAG_FIELDS = {"runner": ("model", "dtype", "device", "page_size", "num_pages", "mem_fraction_static",
                           "gpu_workers", "kv_share", "ep_num_redundant_experts", "init_expert_location",
                           "mem_reserve_bytes"),
                "bootstrap": ("host", "port", "auth", "prefill_peers", "aliases"),
                "scheduler": ("chunked_prefill_size",),
                "transport": ("advertise_host", "mooncake_protocol", "mooncake_device", "mooncake_rank_devices",
                              "warn_exposure"),
                "group": ("tp", "dp", "ep", "nnodes", "node_rank", "dist_init_addr", "deepep_mode")}
# The config each target of the engine-option table names.
_TARGETS = {"runner": RunnerConfig, "bootstrap": BootstrapConfig, "scheduler": SchedulerConfig,
            "transport": TransportConfig, "group": GroupLayout}


def resolve_serve_config(flags: ServeFlags) -> ServeConfig:
    """Validates the flags, reads the checkpoint's config.json, and decides every default."""
    defaults = role_defaults(flags.role)
    check_flags(flags)  # what the flags alone break (workers/serve/flag_rules.py; the operator checks it too)
    for name in ("port", "bootstrap_port"):
        value = getattr(flags, name)
        if not 0 < value < 65536:
            raise UserError(f"--{name.replace('_', '-')} {value} is not a TCP port")
    model_dir = resolve_model_dir(flags.model)
    info = ServedModelInfo.from_model_dir(model_dir, flags.served_model_name or served_name(flags.model, model_dir))
    opts = assign_engine_options(parse_engine_options(flags.all_engine_options))
    group = _group_layout(flags.parallel, opts["group"])
    runner_opts = {**opts["runner"], "ep_size": group.ep, "tp_size": group.tp,
                   "dispatcher": group.dispatcher(deepep_available=_deepep_available()),
                   "dispatch_mode": group.dispatch_mode}
    device = resolve_device(flags.device)
    scheduler_fields = _scheduler_fields(flags, opts, device)
    _graphs_cover_the_batch_cap(runner_opts, scheduler_fields)
    size_low_latency_capacity(runner_opts, scheduler_fields, group, defaults.decodes)
    model_config = ModelConfig.from_hf(model_dir)
    if model_config.num_attention_heads % group.tp:
        raise UserError(f"--tp {group.tp} (attention tensor parallelism) must divide the model's "
                        f"{model_config.num_attention_heads} attention heads")
    runner = _runner_config(flags, defaults, device, model_dir, model_config, runner_opts)
    _check_local_gpus(group, runner.device)
    protocol = _kv_protocol(flags)
    rank_devices = devices_per_local_rank(protocol.devices, group.local_ranks)
    try:
        worker = WorkerConfig(
            kv_transport=flags.kv_transport,
            transport=TransportConfig(advertise_host=flags.advertise_host or advertised_address(flags.host),
                                      mooncake_protocol=protocol.protocol, mooncake_device=rank_devices[0],
                                      mooncake_rank_devices=rank_devices,
                                      **opts["transport"]),
            bootstrap=BootstrapConfig(host=flags.host, port=flags.bootstrap_port,
                                      auth=resolve_auth(flags.internal_secret_file, flags.insecure_internal),
                                      prefill_peers=flags.prefill_peers, aliases=flags.bootstrap_aliases,
                                      **opts["bootstrap"]),
            scheduler=SchedulerConfig(**scheduler_fields))
    except ValueError as exc:  # some configs raise ValueError rather than UserError
        raise UserError(str(exc)) from exc
    runner = _with_staging_reserve(runner, flags.kv_transport, worker.transport, model_config)
    identity = WorkerIdentity(role=flags.role, kv_transport=flags.kv_transport, bootstrap_port=flags.bootstrap_port,
                              page_size=runner.page_size, host=flags.host, port=flags.port,
                              kv_bytes_per_token=bytes_per_pool_page(
                                  kv_layers(model_config, runner.speculative_num_steps > 0), 1,
                                  model_config.kv_cache_dim, runner.resolve_dtype(model_config)))
    return ServeConfig(runner=runner, worker=worker, identity=identity, model=info,
                       server=ServerConfig(flags.host, flags.port, drain_timeout_s=flags.drain_timeout_s),
                       group=group, metrics=MetricsConfig(flags.metrics_host or flags.host, flags.metrics_port))


def _runner_config(flags: ServeFlags, defaults: RoleDefaults, device: str, model_dir: Path,
                   model_config: ModelConfig, options: dict[str, Any]) -> RunnerConfig:
    # Decided before the pool, which --max-total-tokens sizes in whole pages (model/kv/page_size.py).
    page_size = flags.page_size if flags.page_size is not None else \
        default_page_size(model_config, device, flags.dtype)
    fields: dict[str, Any] = {"model": str(model_dir), "device": device, "dtype": flags.dtype, **options,
                              "page_size": page_size,
                              "ep_num_redundant_experts": flags.parallel.ep_num_redundant_experts,
                              "init_expert_location": _absolute(flags.parallel.init_expert_location)}
    fields.update(_pool_size(flags, device, page_size))
    return RunnerConfig.resolve(model_config, graphs_by_default=defaults.decodes, **fields)


def _with_staging_reserve(runner: RunnerConfig, kv_transport: str,
                          transport: TransportConfig, model_config: ModelConfig) -> RunnerConfig:
    """`runner` with its Mooncake staging area's memory kept out of the pool (kv_staging.py)."""
    reserve = staging_reserve_bytes(kv_transport, transport.mooncake_staging_tokens, runner.page_size,
                                    kv_layers(model_config, runner.speculative_num_steps > 0),
                                    model_config.kv_cache_dim, runner.resolve_dtype(model_config).itemsize)
    return dataclasses.replace(runner, mem_reserve_bytes=reserve)


def _scheduler_fields(flags: ServeFlags, opts: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
    """SchedulerConfig's fields: the engine options, --chunked-prefill-size over them, and unset on a
    GPU the chunk for its memory."""
    fields = {**opts["scheduler"], **({"chunked_prefill_size": flags.chunked_prefill_size}
                                      if flags.chunked_prefill_size is not None else {})}
    _default_gpu_chunk(fields, device)
    if fields.get("deterministic"):  # SchedulerConfig says why the prefix cache goes (flag_rules refuses it on)
        fields["prefix_cache"] = False
    return fields


def chunked_prefill_size(flags: ServeFlags, device: str) -> int:
    """The prompt tokens per round a worker started with `flags` on `device` runs, decided as
    `resolve_serve_config` decides them (for tools that time such a round: bench/serving_gpu.py)."""
    opts = assign_engine_options(parse_engine_options(flags.all_engine_options))
    return _scheduler_fields(flags, opts, device).get("chunked_prefill_size", SchedulerConfig.chunked_prefill_size)


def _default_gpu_chunk(scheduler_opts: dict[str, Any], device: str) -> None:
    """Unset on a GPU: the chunked_prefill_size for its memory (module docstring)."""
    if "chunked_prefill_size" in scheduler_opts or not is_cuda(device):
        return
    total = total_memory_bytes(device)
    scheduler_opts["chunked_prefill_size"] = gpu_chunked_prefill_size(total)
    log.info("chunked prefill: %d tokens per round (%s)", scheduler_opts["chunked_prefill_size"],
             f"a GPU of {gib(total, 0)}" if total else "the GPU's memory is unknown")


def _graphs_cover_the_batch_cap(runner_opts: dict[str, Any], scheduler_opts: dict[str, Any]) -> None:
    cap = scheduler_opts.get("max_running_requests", SchedulerConfig.max_running_requests)
    graph_max = runner_opts.setdefault("cuda_graph_max_batch", cap)
    if graph_max < cap:
        log.warning("cuda_graph_max_batch=%d is below max_running_requests=%d: decode batches above %d run "
                    "without CUDA graphs (several times slower per step)", graph_max, cap, graph_max)


def size_low_latency_capacity(runner_opts: dict[str, Any], scheduler_opts: dict[str, Any], group: GroupLayout,
                              decodes: bool) -> None:
    """The low-latency EP layout has a fixed capacity (tokens per rank per step; every rank the
    same): it must cover the largest step that runs in it. Decode steps carry up to
    max_running_requests (and the largest CUDA-graph bucket) sequences, extend steps (only when
    `--deepep-mode low_latency` forces the layout on them) up to chunked_prefill_size tokens;
    under attention TP each rank dispatches 1/tp of its DP group's rows. Unset, the capacity is
    sized to that; set below it (`--engine-opt low_latency_max_tokens=N`), serve refuses to start
    rather than fail on the first large step."""
    if group.ep == 1:
        return
    steps = DispatchMode.parse(runner_opts["dispatch_mode"]).low_latency_steps()
    needs = {}
    if ForwardMode.DECODE in steps and decodes:
        needs["max_running_requests"] = scheduler_opts.get("max_running_requests",
                                                           SchedulerConfig.max_running_requests)
        needs["cuda_graph_max_batch"] = runner_opts.get("cuda_graph_max_batch", 0)
    if ForwardMode.EXTEND in steps:
        needs["chunked_prefill_size"] = scheduler_opts.get("chunked_prefill_size", SchedulerConfig.chunked_prefill_size)
    if not needs:
        return
    cause, largest = max(needs.items(), key=lambda item: item[1])
    per_rank = -(-largest // group.tp)
    given = runner_opts.get("low_latency_max_tokens")
    if given is None:
        runner_opts["low_latency_max_tokens"] = max(per_rank, 1)
        log.info("low-latency EP capacity: %d tokens per rank per step (from %s=%d)", per_rank, cause, largest)
    elif given < per_rank:
        raise UserError(f"--engine-opt low_latency_max_tokens={given} is below what one step can put on a rank in "
                        f"the low-latency EP layout (--deepep-mode {group.deepep_mode}): {cause}={largest}"
                        + (f" over --tp {group.tp} = {per_rank}" if group.tp > 1 else "") + " tokens; raise "
                        f"low_latency_max_tokens or lower {cause}")


def _absolute(path: str | None) -> str | None:
    """A placement file's absolute path (each rank process reads it again, maybe from another cwd)."""
    return None if path is None else str(Path(path).expanduser().resolve())


def _pool_size(flags: ServeFlags, device: str, page_size: int) -> dict[str, Any]:
    """The KV pool's sizing fields: a fixed page count, or a GPU memory fraction (flags checked by flag_rules)."""
    fixed = flags.num_pages
    if flags.max_total_tokens is not None:
        fixed = -(-flags.max_total_tokens // max(page_size, 1))
    if fixed is not None:
        if flags.mem_fraction_static is not None:
            log.info("the KV pool has a fixed size (%d pages); --mem-fraction-static is not used", fixed)
        return {"num_pages": fixed, "mem_fraction_static": None}
    if is_cuda(device):
        return {"num_pages": None, "mem_fraction_static": flags.budget_fraction,
                "gpu_workers": flags.gpu_workers, "kv_share": flags.kv_share}
    given = [flag for flag, value, unset in (("--mem-fraction-static", flags.mem_fraction_static, None),
                                             ("--gpu-workers", flags.gpu_workers, 1), ("--kv-share", flags.kv_share, 1))
             if value != unset]
    if given:
        raise UserError(f"{'/'.join(given)} sizes the KV pool from GPU memory, and the device is {device!r}; "
                        f"pass --num-pages or --max-total-tokens instead")
    return {}  # the CPU: RunnerConfig's fixed default pool


def _kv_protocol(flags: ServeFlags) -> KVProtocolChoice:
    """Mooncake's protocol and devices (rdma_devices.choose_kv_protocol); other transports take none."""
    devices = parse_devices(flags.kv_devices)
    if flags.kv_transport != "mooncake":
        if flags.kv_protocol != "tcp" or devices or flags.kv_tcp_fallback:
            raise UserError(f"--kv-protocol/--kv-devices/--kv-tcp-fallback configure Mooncake; "
                            f"--kv-transport is {flags.kv_transport!r}")
        return choose_kv_protocol("tcp", (), False, ())
    usable = usable_rdma_devices() if flags.kv_protocol == "rdma" else ()
    return choose_kv_protocol(flags.kv_protocol, devices, flags.kv_tcp_fallback, usable)


def _group_layout(par: ParallelFlags, options: dict[str, Any]) -> GroupLayout:
    return GroupLayout(tp=par.tp, dp=par.dp, ep=par.ep, nnodes=par.nnodes, node_rank=par.node_rank,
                       dist_init_addr=par.dist_init_addr, deepep_mode=par.deepep_mode, **options)


def _check_local_gpus(layout: GroupLayout, device: str) -> None:
    """One process per GPU: this node's ranks need as many GPUs (a pod given fewer than the CR's
    gpusPerPod would fail later, rank by rank, in torch.cuda.set_device)."""
    if not is_cuda(device) or layout.is_single_process:
        return
    import torch

    available = torch.cuda.device_count()
    if layout.local_ranks > available:
        raise UserError(f"this node runs {layout.local_ranks} ranks of the group (--tp x --dp = {layout.world} over "
                        f"--nnodes {layout.nnodes}), one per GPU, but it has {available} GPU(s)")


def _deepep_available() -> bool:
    from deepseek_pd.model.moe.dispatcher import DISPATCHERS

    return "deepep" in DISPATCHERS.names()


def advertised_address(bind_host: str) -> str:
    """A wildcard bind address cannot be handed to peers; use this host's own address instead."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise UserError(f"--host {bind_host!r} needs --advertise-host: cannot resolve this "
                        f"machine's address ({exc})") from exc
