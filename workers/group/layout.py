"""`GroupLayout`: how one worker (a group of ranks) spans processes, GPUs and nodes.

One process per rank (on a GPU: per GPU). A group of `world = tp * dp` ranks runs on `nnodes`
nodes (pods) with `world / nnodes` local ranks each; rank = node_rank * local_ranks + local_rank.
Rank 0 serves SglangScheduler and the bootstrap port and spreads requests over the DP groups.

Layout of the model over the ranks: `dp` DP groups of `tp` consecutive ranks each,
    rank = dp_rank * tp + tp_rank.
Each DP group attends its own requests and holds their KV. Within a DP group the `tp` ranks run
the same batch with the MLA heads split between them (attention TP, SGLang's DP-attention with
`attn_tp_size = tp`; model/attention/tensor_parallel.py): q_b_proj, w_kc/w_vc and o_proj are
sliced by heads, o_proj's partial sums are reduced over the TP group, and the latent KV
(shared by all heads) is replicated on every TP rank. Only the group's TP rank 0 (its leader)
runs an engine: it schedules, allocates pages and talks to peers; the others replay its forwards
(model/distributed/tp_replay.py). Dense layers and shared experts are replicated, and each TP rank runs them
on 1/tp of its group's rows (`moe_dense_tp_size=1`); routed experts are spread over all ranks when
`ep == world` (the all-to-all / DeepEP dispatchers: each TP rank dispatches its 1/tp of the rows)
or replicated when `ep == 1` (each TP rank runs all rows). Where the rows live between attention
and the MLPs: model/distributed/scatter_mode.py. `tp == 1` (the default) is plain DP
attention: every rank is its own DP group.

Worked example: `--tp 2 --dp 4 --ep 8` -> world 8; DP groups {0,1} {2,3} {4,5} {6,7}; rank 5 is
DP rank 2, TP rank 1: it holds heads 64..127 of V3's 128, runs DP group 2's batch as rank 4 (its
leader) schedules it, and holds 256 / 8 = 32 routed experts. Rank 0 spreads requests over the
DP leaders 0, 2, 4, 6. The same 8 GPUs as `--dp 8` (tp 1) hold 8 DP groups with 1/8 of the
requests' KV each; tp 2 keeps a second copy of each group's KV and halves the attention weights
and compute per rank.

Example: `serve decode --dp 16 --ep 16 --nnodes 2 --node-rank 1` -> world 16, 8 local ranks,
this node runs ranks 8..15; every rank holds 256 / 16 = 16 routed experts of V3.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.bounds import Bounds, bounds_blocker
from deepseek_pd.errors import UserError

DEEPEP_MODES = ("none", "normal", "low_latency", "auto")


# `GroupLayout`'s engine options with a range (deepseek_pd/bounds.py): the layout applies them, and
# `serve`'s engine-option table before any worker starts.
GROUP_BOUNDS = {name: Bounds(0, open_low=True) for name in ("collective_timeout_s", "startup_timeout_s")}


@dataclass(frozen=True)
class GroupLayout:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""  # HOST:PORT of rank 0's rendezvous; "" on one node: `serve` picks one
    deepep_mode: str = "none"
    collective_timeout_s: float = 60.0  # a step's collectives; a hung peer ends the group after this
    startup_timeout_s: float = 1800.0  # joining the group and loading weights on every rank

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "nnodes"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        world = self.world
        if world % self.nnodes:
            raise UserError(f"--tp {self.tp} x --dp {self.dp} = {world} ranks cannot be spread evenly over "
                            f"--nnodes {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank {self.node_rank} is not in [0, --nnodes {self.nnodes})")
        if self.ep not in (1, world):
            raise UserError(f"--ep {self.ep}: experts are spread over all {world} ranks of the group "
                            f"(--ep {world}) or replicated (--ep 1)")
        if self.deepep_mode not in DEEPEP_MODES:
            raise UserError(f"--deepep-mode {self.deepep_mode!r} is not one of {', '.join(DEEPEP_MODES)}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise UserError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's address)")
        if self.dist_init_addr:
            self.init_host_port()  # validates
        if (blocker := bounds_blocker(GROUP_BOUNDS, collective_timeout_s=self.collective_timeout_s,
                                      startup_timeout_s=self.startup_timeout_s)) is not None:
            raise UserError(blocker)

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def is_single_process(self) -> bool:
        return self.world == 1

    @property
    def local_ranks(self) -> int:
        return self.world // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.local_ranks
        return range(first, first + self.local_ranks)

    @property
    def ep_size(self) -> int:
        return self.ep

    def dp_rank_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def tp_leader_of(self, rank: int) -> int:
        """The global rank of `rank`'s TP rank 0 (its DP group's leader; itself at tp 1)."""
        return rank - rank % self.tp

    @property
    def dp_leaders(self) -> range:
        """The ranks that run engines: TP rank 0 of each DP group, in DP rank order."""
        return range(0, self.world, self.tp)

    def init_host_port(self) -> tuple[str, int]:
        host, sep, port = self.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--dist-init-addr {self.dist_init_addr!r} must be HOST:PORT")
        return host.strip("[]"), int(port)

    def dispatcher(self, deepep_available: bool) -> str:
        """The EP dispatcher for this layout: `deepep` where `deep_ep` imports and a mode asks for it,
        else `all_to_all` with the same semantics (both run the layout `dispatch_mode` picks);
        `local` without EP."""
        if self.ep == 1:
            return "local"
        if self.deepep_mode != "none" and deepep_available:
            return "deepep"
        return "all_to_all"

    @property
    def dispatch_mode(self) -> str:
        """The EP layout per step (model/distributed/dispatch_mode.py), on either dispatcher: `normal` and
        `low_latency` force one for every step, `auto` takes normal for extend steps and
        low-latency for decode steps (so a prefill group runs normal, a decode group low-latency).
        `none` (no DeepEP) keeps the plain all-to-all in the normal layout."""
        return "normal" if self.deepep_mode == "none" else self.deepep_mode
