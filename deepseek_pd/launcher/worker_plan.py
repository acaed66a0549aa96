"""What `deepseek-pd up` starts for each worker: its group shape, its ports and its `serve` command.

Pure (no processes, no sockets): `LocalCluster` reserves the ports and runs the commands; the
unit tests check the plan alone.

Every worker of `up` is one `deepseek-pd serve` process. With `--prefill-ranks N` (or
`--decode-ranks M`) that process is the node supervisor of a group of N ranks on this machine
(workers/serve/group_main.py `run_node`, the same code a pod runs): it spawns one process per rank;
rank 0 serves SglangScheduler and the bootstrap service on the worker's `--port` and
`--bootstrap-port`, the followers' internal ports and the group's rendezvous port are the OS's,
and rank r exports its metrics on `metrics_port + r`. When any rank fails, the supervisor stops
the others and exits non-zero; when it is stopped, it stops every rank. To `up` a group is
therefore one process group to watch and restart, and a restart is always of the whole gang.

Example: `up --prefill 2 --prefill-ranks 2 --decode 1 --decode-ranks 4 --dp 2` plans

    prefill-0  serve prefill --tp 1 --dp 2 --ep 2   port P0, bootstrap B0, metrics M0, M0+1
    prefill-1  serve prefill --tp 1 --dp 2 --ep 2   port P1, bootstrap B1, metrics M1, M1+1
    decode-0   serve decode  --tp 2 --dp 2 --ep 4   port P2, bootstrap B2, metrics M2 .. M2+3

(decode-0: two DP groups of two attention-TP ranks each, workers/group/layout.py), with
every port of every worker distinct.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.memory_budget import GpuShare
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.serve.flags import GROUP_FLAGS, ParallelFlags, ServeFlags

ROLES = ("prefill", "decode")
TBO_CHOICES = ("prefill", "decode", "both")
# `serve`'s GROUP_FLAGS shape a group: `up` derives them from its own flags, so a --worker-arg that
# set one would leave `up` planning ports for another group than the one that runs.


@dataclass(frozen=True)
class GroupShape:
    """One worker's ranks and how the model is spread over them (as `serve` resolves it).

    `ranks` = tp x dp processes; attention is data-parallel over all of them; `ep` is 1 (experts
    replicated on every rank) or `ranks` (each rank holds 1/ranks of the routed experts)."""

    ranks: int = 1
    dp: int = 1
    ep: int = 1
    enable_tbo: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.dp < 1 or self.ranks % self.dp or self.ep not in (1, self.ranks):
            raise UserError(f"invalid worker group: {self.ranks} ranks, dp {self.dp}, ep {self.ep} "
                            f"(dp must divide the ranks; ep is 1 or the ranks)")

    @property
    def tp(self) -> int:
        return self.ranks // self.dp

    def parallel_flags(self) -> ParallelFlags:
        """The `serve` flags of this shape."""
        return ParallelFlags(tp=self.tp, dp=self.dp, ep=self.ep, enable_tbo=self.enable_tbo)

    def describe(self) -> str:
        if self.ranks == 1:
            return "1 rank" + (", TBO" if self.enable_tbo else "")
        return f"{self.ranks} ranks: tp {self.tp}, dp {self.dp}, ep {self.ep}" + (", TBO" if self.enable_tbo else "")


def resolve_group_shape(role: str, ranks: int, dp: int | None = None, ep: int | None = None,
                        enable_tbo: bool = False) -> GroupShape:
    """A role's shape from `up`'s flags, with errors that name them. `dp`/`ep` None: all the ranks
    (pure DP attention, experts spread); they shape multi-rank groups only (one rank: dp = ep = 1)."""
    flag = f"--{role}-ranks"
    if ranks < 1:
        raise UserError(f"{flag} must be >= 1, got {ranks}")
    if ranks == 1:
        return GroupShape(1, 1, 1, enable_tbo)
    dp = ranks if dp is None else dp
    if dp < 1 or ranks % dp:
        raise UserError(f"--dp {dp} must divide {flag} {ranks}: a group's ranks are tp x dp "
                        f"(tp = {flag} / --dp, run as DP attention)")
    ep = ranks if ep is None else ep
    if ep not in (1, ranks):
        raise UserError(f"--ep {ep}: a {role} group spreads its experts over all {flag} {ranks} ranks "
                        f"(--ep {ranks}, the default) or replicates them (--ep 1)")
    return GroupShape(ranks, dp, ep, enable_tbo)


def check_worker_args(worker_args: Sequence[str], shapes: Mapping[str, GroupShape] | None = None) -> None:
    """Refuses a --worker-arg that would change a group's shape behind `up`'s back, that is no
    `serve` flag, or that a worker of either role would refuse from its flags alone (`serve`'s flag
    rules, workers/serve/flag_rules.py, as the operator applies them to engineArgs: an `--engine-opt`
    key no worker has, a value not of its type, `cuda_graph=true` on prefill, ...), with each
    role's group shape (`shapes`; default one rank): before any worker starts, not in every
    worker's log as it restarts."""
    for arg in worker_args:
        name = arg.split("=", 1)[0]
        if name in GROUP_FLAGS:
            raise UserError(f"--worker-arg={arg}: `up` sets the workers' group flags itself; use "
                            f"--prefill-ranks/--decode-ranks/--dp/--ep/--enable-tbo")
    for role in ROLES:
        try:
            flags = ServeFlags.from_argv([role, *worker_args])
        except ValueError as exc:
            raise UserError(f"--worker-arg: {exc}") from None
        shape = (shapes or {}).get(role, GroupShape())
        check_flags(dataclasses.replace(flags, parallel=dataclasses.replace(
            flags.parallel, tp=shape.tp, dp=shape.dp, ep=shape.ep, enable_tbo=shape.enable_tbo)))


@dataclass(frozen=True)
class WorkerPlan:
    """One worker (a group of `shape.ranks` processes): its name, ports and GPU memory flags."""

    role: str
    index: int
    shape: GroupShape
    port: int  # rank 0's SglangScheduler port: what the router dials
    bootstrap_port: int  # prefill: rank 0's bootstrap service (the Route table for the other ranks)
    metrics_port: int  # rank r exports on metrics_port + r
    gpu_share: GpuShare | None = None  # gpu_share.worker_gpu_shares: each rank's part of its GPU

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def metrics_ports(self) -> range:
        return range(self.metrics_port, self.metrics_port + self.shape.ranks)

    def ports(self) -> list[int]:
        """Every port this worker binds on its own (not the OS-picked ones of its followers)."""
        return [self.port, self.bootstrap_port, *self.metrics_ports]


def port_block_sizes(shapes: Sequence[GroupShape]) -> list[int]:
    """The runs of consecutive ports the workers need, in `plan_workers`' order: gRPC, bootstrap,
    and one metrics port per rank, for each worker."""
    return [size for shape in shapes for size in (1, 1, shape.ranks)]


def plan_workers(roles: Sequence[str], shapes: Sequence[GroupShape], block_starts: Sequence[int],
                 gpu_shares: Sequence[GpuShare | None] | None = None) -> list[WorkerPlan]:
    """One plan per worker; `block_starts` are the first ports of `port_block_sizes(shapes)`'s runs."""
    if len(roles) != len(shapes) or len(block_starts) != 3 * len(shapes):
        raise ValueError("one shape and three port blocks per worker")
    gpu_shares = gpu_shares or [None] * len(roles)
    counters = dict.fromkeys(ROLES, 0)
    plans = []
    for i, (role, shape, share) in enumerate(zip(roles, shapes, gpu_shares)):
        port, bootstrap_port, metrics_port = block_starts[3 * i:3 * i + 3]
        plans.append(WorkerPlan(role, counters[role], shape, port, bootstrap_port, metrics_port, share))
        counters[role] += 1
    return plans


@dataclass(frozen=True)
class ServeSettings:
    """What every worker of one cluster is started with, whatever its role."""

    model_dir: str
    served_model_name: str
    host: str
    kv_transport: str
    device: str
    secret_file: str  # the run's deployment secret (workers/transport/internal_auth.py)
    worker_args: tuple[str, ...] = ()  # last on the command line: they win
    mem_fraction_static: float | None = None  # the budget of all workers on a GPU; None: serve's default
    speculative_num_steps: int = 0  # both roles alike: a PD pair whose MTP settings differ refuse each other
    python: str = sys.executable


# What `up` always spells out, defaults included: what the router and the other workers are told.
_ALWAYS = ("model", "served_model_name", "host", "port", "bootstrap_port", "kv_transport", "device")


def serve_flags(plan: WorkerPlan, plans: Sequence[WorkerPlan], settings: ServeSettings) -> ServeFlags:
    """The `serve` flags of `plan`'s worker (before `worker_args`); `plans` (all workers) give decode
    its prefill peers: every prefill group's rank 0 (the other ranks are learnt from its signed Route
    table)."""
    s = settings
    peers = tuple(f"{s.host}:{p.bootstrap_port}" for p in plans if p.role == "prefill") if plan.role == "decode" else ()
    share = plan.gpu_share
    memory = {} if share is None else {"mem_fraction_static": s.mem_fraction_static,
                                       "gpu_workers": share.workers, "kv_share": share.share}
    return ServeFlags(role=plan.role, model=s.model_dir, served_model_name=s.served_model_name, host=s.host,
                      port=plan.port, bootstrap_port=plan.bootstrap_port, kv_transport=s.kv_transport,
                      metrics_port=plan.metrics_port, device=s.device, parallel=plan.shape.parallel_flags(),
                      internal_secret_file=s.secret_file, prefill_peers=peers,
                      speculative_num_steps=s.speculative_num_steps, **memory)


def serve_argv(plan: WorkerPlan, plans: Sequence[WorkerPlan], settings: ServeSettings) -> list[str]:
    """The command line of `plan`'s worker: its contract flags, then `worker_args` (they win)."""
    flags = serve_flags(plan, plans, settings)
    return [settings.python, "-m", "deepseek_pd.cli", "serve", *flags.to_argv(always=_ALWAYS), *settings.worker_args]
