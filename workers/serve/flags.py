"""The `deepseek-pd serve` command line, defined once (as SGLang's `ServerArgs`). Torch-free: the
operator reads it too.

Each field of `ServeFlags` (and of `ParallelFlags`, whose flags sit flat on the command line)
carries its flag in its metadata: the CLI name, the help, the choices, whether the operator
renders it, whether it shapes a group, whether it spells an engine option. Everything else is derived from that one definition:
- `add_cli_args(parser)` builds the options of the CLI's `serve` sub-command;
- `ServeFlags.from_cli_args(namespace)` reads them back, nothing resolved yet
  (workers/serve/resolution.py decides every default and "auto");
- `flags.to_argv()` renders a worker's command line (`up`'s workers, the operator's pods);
- `ServeFlags.from_argv(argv)` parses one, a bad one as a ValueError (the operator's memory plan
  reads a role's engineArgs so);
- `flags.all_engine_options`: the `--engine-opt` items, with the flags that spell an engine option
  (kind `engine_option`: --enable-tbo, --speculative-num-steps, --deterministic) after them;
- `MANAGED_FLAGS`: the flags the operator renders, which a role's engineArgs may not repeat (the
  CRD's rule, operator/crd_spec.py); `GROUP_FLAGS`: the flags `up` derives from its own.

Example:
    ServeFlags(role="decode", port=30010, parallel=ParallelFlags(dp=2, ep=2)).to_argv()
    == ["decode", "--port", "30010", "--dp", "2", "--ep", "2"]
and `ServeFlags.from_argv` of that list gives the same flags back. Only values other than the
default are rendered, unless named in `always`.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from deepseek_pd.model.config import DTYPE_CHOICES
from deepseek_pd.model.kv.memory_budget import DEFAULT_MEM_FRACTION_STATIC, GpuShare
from deepseek_pd.model.kv.page_size import UNSET_PAGE_SIZE
from deepseek_pd.workers.serve.roles import ROLES

PARALLEL_SECTION = "parallelism (one worker over several GPUs/nodes)"
SECURITY_SECTION = "internal authentication (docs/operations.md, Security)"


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line."""

    help: str
    name: str = ""  # without "--"; "": the field's name with dashes
    type: Callable[[str], Any] | None = None  # None: the default's type (str for a None default)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    managed: bool = False  # the operator renders it (operator/build_workers.py)
    shapes_group: bool = False  # `up` renders it from its own flags (launcher/worker_plan.py)
    section: str = ""  # the argparse group it is listed under
    exclusive: str = ""  # flags with the same key exclude each other
    csv: bool = False  # a tuple given as one comma-separated value, not a repeated flag
    # The flag spells `--engine-opt <field>=<value>`: a field of a worker config of the same name
    # (workers/serve/engine_options.py). `ServeFlags.all_engine_options` hands it on after the
    # --engine-opt items, so the flag wins; serve resolution has no code of its own for it.
    engine_option: bool = False


def _flag(default: Any, help: str, **options: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(help, **options)})


@dataclass(frozen=True)
class ParallelFlags:
    """How one worker spans GPUs and nodes (the operator's LWS-style flags)."""

    tp: int = _flag(1, "attention tensor parallel size: ranks of one DP group that split the MLA heads and "
                       "run the same batch (world = tp x dp)", managed=True, shapes_group=True,
                    section=PARALLEL_SECTION)
    dp: int = _flag(1, "data parallel (attention) groups: each attends its own requests and holds their KV",
                    managed=True, shapes_group=True, section=PARALLEL_SECTION)
    ep: int = _flag(1, "expert parallel size", managed=True, shapes_group=True, section=PARALLEL_SECTION)
    deepep_mode: str = _flag("none", "DeepEP all-to-all mode", choices=("none", "normal", "low_latency", "auto"),
                             managed=True, section=PARALLEL_SECTION)
    nnodes: int = _flag(1, "nodes (pods) in this worker's group", managed=True, shapes_group=True,
                        section=PARALLEL_SECTION)
    node_rank: int = _flag(0, "this pod's rank in the group", managed=True, shapes_group=True,
                           section=PARALLEL_SECTION)
    dist_init_addr: str = _flag("", "HOST:PORT of rank 0, for torch.distributed", managed=True,
                                shapes_group=True, section=PARALLEL_SECTION)
    enable_tbo: bool = _flag(
        False, "two-batch overlap: each batch as two micro-batches whose EP all-to-alls overlap the other's "
               "compute (the same as --engine-opt enable_tbo=true). SGLang's split: decode in half, extend "
               "where the tokens balance, one dominating prompt cut in two chunks (--engine-opt "
               "tbo_token_distribution_threshold=0.48, 0: never); the group splits when its busiest rank has "
               "--engine-opt tbo_min_decode_tokens / tbo_min_extend_tokens (default 2) tokens, idle ranks "
               "take part", shapes_group=True, engine_option=True, section=PARALLEL_SECTION)
    # EPLB (model/eplb/): extra expert slots over the group, and a placement file
    ep_num_redundant_experts: int = _flag(
        0, "EPLB: R extra physical expert slots per MoE layer over the EP group, holding replicas of hot "
           "experts ((n_routed_experts + R) must divide by --ep; default 0)", metavar="R",
        section=PARALLEL_SECTION)
    init_expert_location: str | None = _flag(
        None, "EPLB: placement JSON (physical_to_logical_map per MoE layer, e.g. from `deepseek-pd eplb "
              "plan`); default: slot p holds expert p mod n_routed_experts", metavar="FILE",
        section=PARALLEL_SECTION)

    @property
    def is_single_process(self) -> bool:
        return self.tp == self.dp == self.ep == self.nnodes == 1


@dataclass(frozen=True)
class ServeFlags:
    """What `deepseek-pd serve` was told, as given: None means "the default", "auto" means "decide"."""

    role: str  # the positional argument: prefill or decode
    model: str = _flag("tiny", "HF checkpoint directory, or 'tiny' (default)", managed=True)
    served_model_name: str | None = _flag(
        None, "name clients put in 'model' (default: 'tiny' or the directory name)", managed=True)
    host: str = _flag("127.0.0.1", "address to listen on (default 127.0.0.1)", managed=True)
    advertise_host: str | None = _flag(
        None, "address peers reach this worker at (KV transfer); default: --host, or this machine's address "
              "when --host is 0.0.0.0 (the pod IP in Kubernetes)", managed=True)
    bootstrap_aliases: tuple[str, ...] = _flag(
        (), "prefill: another name decode workers may dial this bootstrap service at (e.g. the pod's DNS "
            "name, which the router hands decode); repeatable", name="bootstrap-alias", metavar="NAME",
        managed=True)
    port: int = _flag(30001, "gRPC port (default 30001)", managed=True)
    bootstrap_port: int = _flag(8998, "prefill: port of the bootstrap (handshake/KV) service (default 8998)",
                                managed=True)
    kv_transport: str = _flag("grpc", "how KV moves from prefill to decode (default grpc)",
                              choices=("mooncake", "grpc"), managed=True)
    kv_protocol: str = _flag("tcp", "mooncake: the transfer engine's protocol (default tcp)",
                             choices=("tcp", "rdma"), managed=True)
    kv_devices: str = _flag("", "mooncake rdma: the RDMA devices to use, e.g. mlx5_0,mlx5_1 (default: all "
                                "usable)", metavar="HCA[,HCA...]", managed=True)
    kv_tcp_fallback: bool = _flag(False, "mooncake rdma: use tcp (with a warning) when no RDMA device is "
                                         "usable, instead of refusing to start", managed=True)
    device: str = _flag("auto", "torch device: auto (CUDA when available, else cpu; default), cpu, cuda, cuda:N",
                        managed=True)
    dtype: str = _flag("auto", "model dtype; auto: the checkpoint's torch_dtype on CUDA (bfloat16 for FP8 "
                               "checkpoints), float32 on cpu",
                       choices=DTYPE_CHOICES)
    page_size: int | None = _flag(
        None, f"KV page size in tokens; prefill and decode must use the same (default: {UNSET_PAGE_SIZE}, i.e. "
              f"CUDA, a Hopper GPU, flash_mla built and a bf16 model; model/kv/page_size.py)", type=int)
    num_pages: int | None = _flag(None, "KV pool size in pages (overrides --mem-fraction-static)", type=int,
                                  exclusive="pool")
    max_total_tokens: int | None = _flag(
        None, "KV pool size in tokens, rounded up to whole pages (overrides --mem-fraction-static)", type=int,
        exclusive="pool")
    mem_fraction_static: float | None = _flag(
        None, "CUDA: the fraction of the GPU's total memory for the weights, KV pools and activation headroom "
              f"of the workers on it (default {DEFAULT_MEM_FRACTION_STATIC}; cpu: a fixed pool of 1024 pages)",
        type=float)
    gpu_workers: int = _flag(
        1, "CUDA: workers sharing this GPU, each with its own copy of the weights (`up` sets it); the KV room "
           "is what --mem-fraction-static leaves after all their weights and headroom (default 1)")
    kv_share: float = _flag(
        1.0, "CUDA: this worker's share of that KV room (`up` sets it by role, 2 prefill : 3 decode; default 1)")
    chunked_prefill_size: int | None = _flag(
        None, "prompt tokens per prefill round (default: 2048 on the CPU; on a GPU by its memory, as SGLang: "
              "2048 below 35 GiB, 8192 below 160 GiB, else 16384)", type=int)
    parallel: ParallelFlags = field(default_factory=ParallelFlags)
    internal_secret_file: str | None = _flag(
        None, "file with the deployment secret that signs bootstrap/KV messages (default: "
              "$DEEPSEEK_PD_INTERNAL_SECRET_FILE); `up` and the operator provide one", managed=True,
        section=SECURITY_SECTION)
    insecure_internal: bool = _flag(False, "DEBUGGING ONLY: no authentication of bootstrap/KV messages",
                                    managed=True, section=SECURITY_SECTION)
    prefill_peers: tuple[str, ...] = _flag(
        (), "decode: comma-separated HOST:PORT bootstrap addresses of this deployment's prefill workers; KV is "
            "pulled from no other (default: loopback hosts only)", csv=True, managed=True,
        section=SECURITY_SECTION)
    speculative_num_steps: int = _flag(
        0, "decode: tokens the checkpoint's MTP layer drafts per step, verified in one forward (0..8, default "
           "0: off; the same as --engine-opt speculative_num_steps=N); a PD prefill worker takes the same "
           "value, so both KV layouts hold the MTP layer", metavar="N", managed=True, engine_option=True)
    deterministic: bool = _flag(
        False, "batch-invariant inference (docs/deterministic.md): greedy outputs do not depend on what else "
               "is batched; prompts cut at multiples of --chunked-prefill-size, no prefix cache; refuses TBO, "
               "TP/EP > 1, speculation and FP8 GEMMs kept in FP8 (the same as --engine-opt deterministic=true)",
        engine_option=True)
    engine_options: tuple[str, ...] = _flag(
        (), "any field of the worker's configs, repeatable (e.g. cuda_graph=false, max_running_requests=32, "
            "mem_headroom_gib=4); unknown keys list the valid ones", name="engine-opt", metavar="KEY=VALUE")
    engine_factory: str | None = _flag(
        None, "TEST HOOK: build the engine with this function (it gets the resolved ServeConfig and the "
              "WorkerMetrics) instead of the role's default builder", metavar="MODULE:FUNC")
    metrics_port: int | None = _flag(
        None, "serve Prometheus metrics at http://--metrics-host:PORT/metrics (default: off); a multi-rank "
              "group serves rank r of a node on PORT + r", type=int, managed=True)
    metrics_host: str | None = _flag(None, "address of the metrics exporter (default: --host)", managed=True)
    drain_timeout_s: float = _flag(30.0, "seconds to let running requests finish after SIGTERM (default 30)",
                                   name="drain-timeout")

    @property
    def all_engine_options(self) -> tuple[str, ...]:
        """The --engine-opt items, then `name=value` for each flag of kind `engine_option` that is
        not at its default (--enable-tbo, --speculative-num-steps, --deterministic)."""
        return self.engine_options + tuple(
            f"{spec.name}={_option_value(value)}" for owner, spec in _flag_fields()
            if spec.metadata["flag"].engine_option
            and (value := getattr(self.parallel if owner else self, spec.name)) != spec.default)

    @property
    def budget_fraction(self) -> float:
        """The GPU memory budget's fraction: --mem-fraction-static, else the default (CUDA only)."""
        return DEFAULT_MEM_FRACTION_STATIC if self.mem_fraction_static is None else self.mem_fraction_static

    @property
    def gpu_share(self) -> GpuShare:
        """This worker's place on its GPU (model/kv/memory_budget.py); ValueError when out of range."""
        return GpuShare(self.gpu_workers, self.kv_share)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServeFlags":
        """The flags `add_cli_args` parsed into `args`."""
        values: dict[str, dict[str, Any]] = {"": {}, "parallel": {}}
        for owner, spec in _flag_fields():
            raw = getattr(args, spec.name)
            flag = spec.metadata["flag"]
            if flag.csv:
                raw = tuple(item for item in raw.split(",") if item.strip())
            elif isinstance(spec.default, tuple):
                raw = tuple(raw)
            values[owner][spec.name] = raw
        return cls(role=args.role, parallel=ParallelFlags(**values["parallel"]), **values[""])

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "ServeFlags":
        """`[role, *flags]` as `serve` parses it; a ValueError names what it refuses."""
        parser = _RaisingParser(prog="deepseek-pd serve", add_help=False)
        add_cli_args(parser)
        return cls.from_cli_args(parser.parse_args(list(argv)))

    def to_argv(self, always: Collection[str] = (), text: Mapping[str, str] | None = None) -> list[str]:
        """`[role, *flags]`: each field whose value is not its default, or that `always` names (when
        it has a value); `text` gives a field's value as text (a `$(VAR)` the kubelet expands)."""
        text = text or {}
        argv = [self.role]
        for owner, spec in _flag_fields():
            value = getattr(self.parallel if owner else self, spec.name)
            option = "--" + cli_name(spec)
            if spec.name in text:
                argv += _option(option, text[spec.name])
            elif value != spec.default or spec.name in always:
                argv += _render(option, spec, value)
        return argv


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message)


def _flag_fields() -> Iterator[tuple[str, dataclasses.Field]]:
    """(owner, field) of every flag: ServeFlags' own (owner ""), ParallelFlags' in place of `parallel`."""
    for spec in dataclasses.fields(ServeFlags):
        if spec.name == "parallel":
            yield from (("parallel", inner) for inner in dataclasses.fields(ParallelFlags))
        elif "flag" in spec.metadata:
            yield "", spec


def cli_name(spec: dataclasses.Field) -> str:
    return spec.metadata["flag"].name or spec.name.replace("_", "-")


def _option_value(value: Any) -> str:
    """A value as `--engine-opt` spells it (engine_options.parse_bool reads "true")."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _option(option: str, text: str) -> list[str]:
    # A value that starts with "-" would read as a flag of its own.
    return [f"{option}={text}"] if text.startswith("-") else [option, text]


def _render(option: str, spec: dataclasses.Field, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [option]
    if isinstance(value, tuple):
        if spec.metadata["flag"].csv:
            return _option(option, ",".join(value)) if value else []
        return [arg for item in value for arg in _option(option, str(item))]
    return _option(option, str(value))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` arguments: the role, then every flag of the contract."""
    parser.add_argument("role", choices=list(ROLES))
    sections: dict[str, Any] = {"": parser}
    exclusive: dict[str, Any] = {}
    for _, spec in _flag_fields():
        flag: Flag = spec.metadata["flag"]
        if flag.section not in sections:
            sections[flag.section] = parser.add_argument_group(flag.section)
        container = sections[flag.section]
        if flag.exclusive:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = container.add_mutually_exclusive_group()
            container = exclusive[flag.exclusive]
        # Shown as the flag's name, not the field's (--drain-timeout DRAIN_TIMEOUT)
        metavar = flag.metavar or cli_name(spec).upper().replace("-", "_")
        kwargs: dict[str, Any] = {"dest": spec.name, "help": flag.help}
        if isinstance(spec.default, bool):
            kwargs.update(action="store_true", default=spec.default)
        elif isinstance(spec.default, tuple) and not flag.csv:
            kwargs.update(action="append", default=[], metavar=metavar)
        else:
            kind = flag.type or (str if spec.default is None or flag.csv else type(spec.default))
            default = ",".join(spec.default) if flag.csv else spec.default
            kwargs.update(type=kind, default=default, metavar=None if flag.choices else metavar)
            if flag.choices:
                kwargs["choices"] = list(flag.choices)
        container.add_argument("--" + cli_name(spec), **kwargs)


def flag_names(keep: Callable[[Flag], bool]) -> tuple[str, ...]:
    """The CLI names (without "--") of the flags `keep` selects, in the contract's order."""
    return tuple(cli_name(spec) for _, spec in _flag_fields() if keep(spec.metadata["flag"]))


MANAGED_FLAGS = flag_names(lambda flag: flag.managed)
GROUP_FLAGS = tuple(f"--{name}" for name in flag_names(lambda flag: flag.shapes_group))
