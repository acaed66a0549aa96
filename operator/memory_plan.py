"""Does a deployment fit its GPUs? The per-rank memory plan behind the `MemoryPlanFits` condition.

Pure: `plan_memory(spec)` reads the parsed spec only. For every role that runs on GPUs it adds up
what one rank must hold, and compares it with the budget the worker will size itself by
(model/kv/pool_sizing.py):

    weights   weight_bytes.rank_weights: FP8 checkpoints stay FP8 (1 byte + a fp32 scale per
              128x128 block) unless engineArgs has `--engine-opt fp8_backend=dequant`; otherwise
              the model dtype (`--dtype`, auto: bf16). Routed expert slots (the experts plus
              `--ep-num-redundant-experts`) / ep, the rest replicated.
    MTP       with speculative decoding (decode.speculative.numSteps > 0, rendered into both roles,
              or --speculative-num-steps in engineArgs) the MTP layer's weights are counted with the
              rest, and its latent KV is one pool layer more (model/speculative/mtp_names.py kv_layers).
    KV        (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes per token, for a fixed pool
              (`--num-pages`, `--max-total-tokens`) its size, else at least one request of the
              model's whole context (max_position_embeddings), rounded up to pages.
    staging   a decode or prefill rank over Mooncake (prefill: where each send is encrypted) allocates a staging
              area of `mooncake_staging_tokens` (16,384 by default) beside its pool: the same latent KV
              per token, in whole pages (workers/serve/kv_staging.py, the rule the worker keeps out of
              its pool by). V3 with its MTP layer: 1.1 GiB; V2-Lite 0.5 GiB.
    graphs    the activation and CUDA-graph headroom the worker keeps inside its budget
              (`mem_headroom_gib`; by default model/kv/memory_headroom.py's rule: 2 GiB, in
              proportion above a largest graph batch of 128 on a decode role).
    budget    mem_fraction_static (0.88 unless `--mem-fraction-static`) x the GPU's memory; with
              `--gpu-workers N --kv-share S` (workers sharing one GPU, as `up` runs them) the
              rank's weights and headroom plus S of what the budget leaves after N of them
              (model/kv/memory_budget.py, the rule the worker sizes its pool by).

The 12% outside the budget is the CUDA context, NCCL and DeepEP buffers. The split follows
SGLang's, whose default mem_fraction_static is (GPU memory - reserved) / GPU memory with `reserved`
at least 10 GiB on GPUs over 60 GB, more for large chunked prefills, CUDA-graph batch sizes and
DP attention, and 0.88 when the GPU's size is unknown (`ServerArgs._handle_gpu_memory_settings`
in python/sglang/srt/server_args.py): on an H200 our 0.88 leaves 16.8 GiB outside the budget.

Worked example, examples/deepseek-v3-h200.yaml, prefill (EP16, FP8, with the MTP layer, Mooncake RDMA):
    weights 58.1 GiB + KV 10.9 GiB + graphs 2.0 GiB + KV staging 1.1 GiB = 72.1 GiB of 123.0 GiB
    per rank -> fits;
the same on one node (EP8) with `fp8_backend=dequant` needs 187.6 GiB of bf16 weights -> does not.

Verdicts: True/Fits, True/NotApplicable (no role on GPUs), Unknown/ModelUnknown or GpuUnknown
(nothing to plan with: the workers start, unchecked), False/DoesNotFit, False/InvalidLayout (ep
does not divide the routed experts plus the redundant ones), False/InvalidEngineArgs (a memory flag the worker would
refuse). Only False stops the operator from creating children.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.model.config import ModelConfig, latent_kv_bytes
from deepseek_pd.model.kv.memory_headroom import default_headroom_gib
from deepseek_pd.model.speculative.mtp_names import kv_layers
from deepseek_pd.model.speculative.rules import graph_tokens_per_sequence
from deepseek_pd.operator import known_models
from deepseek_pd.operator.gpu_types import GIB, GpuMemory, gpu_memory
from deepseek_pd.model.kv.memory_budget import budget_bytes
from deepseek_pd.model.config import DTYPE_BYTES
from deepseek_pd.operator.memory_flags import MemoryFlags, parse_memory_flags
from deepseek_pd.operator.spec import DeploymentSpec, RoleSpec
from deepseek_pd.operator.weight_bytes import WeightFormat, rank_weights
from deepseek_pd.workers.serve.kv_staging import staging_reserve_bytes
from deepseek_pd.workers.serve.roles import role_defaults


@dataclass(frozen=True)
class RankMemory:
    """What one rank of a role needs, against the budget its worker sizes itself by."""

    role: str
    ranks: int  # per group
    weight_format: str  # "FP8" (kept FP8, with block scales) or the model dtype
    weights_bytes: int
    kv_tokens: int
    fixed_pool: bool  # the flags fix the pool's size; else kv_tokens is its minimum
    kv_bytes_per_token: int
    reserve_bytes: int
    budget_bytes: int
    staging_bytes: int = 0  # a Mooncake staging area beside the pool (workers/serve/kv_staging.py)

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def fp8(self) -> bool:
        return self.weight_format == "FP8"

    @property
    def needed_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.reserve_bytes + self.staging_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget_bytes

    def describe(self) -> str:
        kv = (f"a fixed pool of {self.kv_tokens} tokens" if self.fixed_pool
              else f"at least one {self.kv_tokens}-token request")
        line = (f"{self.role} ({self.ranks} rank(s), {self.weight_format} weights): weights "
                f"{_gib(self.weights_bytes)} + KV {_gib(self.kv_bytes)} ({kv}) + graphs "
                f"{_gib(self.reserve_bytes)}"
                + (f" + KV staging {_gib(self.staging_bytes)}" if self.staging_bytes else "")
                + f" = {_gib(self.needed_bytes)} of {_gib(self.budget_bytes)} per rank")
        spare = self.budget_bytes - self.weights_bytes - self.reserve_bytes - self.staging_bytes
        if self.fits and not self.fixed_pool:
            line += f", a KV pool of {_gib(spare)} ({spare // self.kv_bytes_per_token:,} tokens)"
        return line


@dataclass(frozen=True)
class MemoryVerdict:
    """The MemoryPlanFits condition: status True, False or None (Unknown)."""

    status: bool | None
    reason: str
    message: str
    ranks: tuple[RankMemory, ...] = ()

    @property
    def refused(self) -> bool:
        return self.status is False


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def model_name(spec: DeploymentSpec) -> str | None:
    """The `known_models` entry the spec's model is, by model.architecture or by its names."""
    model = spec.model
    if model.architecture:
        return model.architecture
    names = ([model.hub.repo] if model.hub else [model.path]) + [model.served_name]
    return next(filter(None, map(known_models.recognise, names)), None)


def headroom_gib(role: RoleSpec, flags: MemoryFlags) -> float:
    """The headroom a rank of `role` keeps (`RunnerConfig.headroom_gib` of its worker):
    `mem_headroom_gib`, else model/kv/memory_headroom.py's default for its largest captured batch.

    Whether the rank captures CUDA graphs, as `RunnerConfig.resolve` and `cuda_graph_blocker`
    decide it: a decode role does by default, except under attention TP (speculative draft and verify graphs
    included); `cuda_graph` overrides
    the default; TBO and expert-load recording keep graphs off whatever it says; with speculative
    decoding the largest graph (the verify) holds k + 1 tokens per sequence. Backends the
    image decides (DeepEP) are assumed capturable: the plan errs towards the larger headroom. The
    largest batch is `cuda_graph_max_batch`, else `max_running_requests`.
    """
    if flags.mem_headroom_gib is not None:
        return flags.mem_headroom_gib
    graphs_by_default = role_defaults(role.role).decodes and role.parallelism.tp == 1
    capturable = not (flags.enable_tbo or flags.record_expert_load)
    graphs = capturable and (graphs_by_default if flags.cuda_graph is None else flags.cuda_graph)
    batch = flags.cuda_graph_max_batch if flags.cuda_graph_max_batch is not None else flags.max_running_requests
    return default_headroom_gib(batch * graph_tokens_per_sequence(flags.speculative_num_steps) if graphs else 0)


def rank_memory(role: RoleSpec, config: ModelConfig, flags: MemoryFlags, gpu: GpuMemory) -> RankMemory:
    """One rank of `role` (see the module docstring for each term)."""
    serve = flags.serve
    dtype = serve.dtype if serve.dtype != "auto" else ("bfloat16" if config.is_fp8 else config.torch_dtype)
    itemsize = DTYPE_BYTES[dtype]
    fp8 = config.is_fp8 and flags.fp8_backend != "dequant"
    block = tuple(config.quantization["weight_block_size"]) if fp8 else None
    weights = rank_weights(config, WeightFormat(itemsize, block), role.parallelism.ep,
                           flags.num_fused_shared_experts, serve.parallel.ep_num_redundant_experts,
                           mtp=flags.mtp)
    per_token = latent_kv_bytes(kv_layers(config, flags.mtp), config.kv_cache_dim, itemsize)
    tokens = flags.fixed_pool_tokens
    fixed = tokens is not None
    if tokens is None:  # one request of the whole context, in whole pages
        tokens = -(-config.max_position_embeddings // flags.page_size) * flags.page_size
    reserve = int(headroom_gib(role, flags) * GIB)
    staging = staging_reserve_bytes(serve.kv_transport, flags.mooncake_staging_tokens, flags.page_size, kv_layers(config, flags.mtp),
                                    config.kv_cache_dim, itemsize)
    budget = serve.gpu_share.worker_budget(budget_bytes(serve.budget_fraction, gpu.total_bytes),
                                           weights.total_bytes + reserve + staging)
    return RankMemory(role=role.role, ranks=role.world_size, weight_format="FP8" if fp8 else dtype,
                      weights_bytes=weights.total_bytes, kv_tokens=tokens, fixed_pool=fixed,
                      kv_bytes_per_token=per_token, reserve_bytes=reserve, budget_bytes=budget,
                      staging_bytes=staging)


def _rendered(spec: DeploymentSpec) -> list[str]:
    """The memory-relevant flags the operator renders for every role (build_workers.py): the
    speculative steps, and the KV transport (a Mooncake staging area)."""
    steps = spec.speculative_num_steps
    kv = spec.kv_transfer
    transport = [f"--kv-transport={kv.backend}"]
    if kv.backend == "mooncake":
        transport.append(f"--kv-protocol={kv.protocol}")
    return transport + ([f"--speculative-num-steps={steps}"] if steps else [])


def plan_memory(spec: DeploymentSpec, model: tuple[str, ModelConfig] | None = None) -> MemoryVerdict:
    """The MemoryPlanFits verdict of a valid spec (module docstring). `model`: (a label, the
    config) to plan with instead of the known shape the spec names, e.g. a local config.json."""
    roles = [r for r in (spec.prefill, spec.decode) if r.gpus_per_pod > 0 and r.replicas > 0]
    if not roles:
        return MemoryVerdict(True, "NotApplicable", "no role with replicas runs on GPUs")
    name = model[0] if model else model_name(spec)
    if name is None:
        return MemoryVerdict(None, "ModelUnknown", (
            f"the model ({spec.model.tokenizer_path}) is none of {', '.join(known_models.KNOWN_MODELS)}; "
            "set model.architecture to have the memory plan checked"))
    gpu = gpu_memory(spec.scheduling)
    if gpu is None:
        return MemoryVerdict(None, "GpuUnknown", (
            "no GPU type to plan for: pin the workers to one with scheduling.nodeSelector "
            "nvidia.com/gpu.product (e.g. NVIDIA-H200) or nvidia.com/gpu.memory (MiB)"))
    config = model[1] if model else known_models.model_config(name)
    ranks = []
    for role in roles:
        try:
            flags = parse_memory_flags(role.role, [*_rendered(spec), *role.engine_args])
        except ValueError as exc:
            return MemoryVerdict(False, "InvalidEngineArgs", f"{role.role}.engineArgs: {exc}")
        try:
            ranks.append(rank_memory(role, config, flags, gpu))
        except ValueError as exc:  # the experts (and replicas) do not split evenly over the ranks
            return MemoryVerdict(False, "InvalidLayout", f"{role.role}.parallelism: {name}: {exc}")
    fits = all(r.fits for r in ranks)
    message = (f"{name} on {gpu.name} ({_gib(gpu.total_bytes)} per GPU, from {gpu.source}): "
               + "; ".join(r.describe() for r in ranks))
    if not fits:
        message += (". It does not fit: spread the experts over more ranks, keep FP8 weights, "
                    "use GPUs with more memory, or give a smaller fixed KV pool")
    return MemoryVerdict(fits, "Fits" if fits else "DoesNotFit", message, tuple(ranks))
