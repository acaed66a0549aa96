"""`GroupLayout`: how one worker (a group of ranks) spans processes, GPUs and nodes.

One process per rank (on a GPU: per GPU). A group of `world = tp * dp` ranks runs on `nnodes`
nodes (pods) with `world / nnodes` local ranks each; rank = node_rank * local_ranks + local_rank.
Rank 0 serves SglangScheduler and the bootstrap port and spreads requests over the DP ranks.

Layout of the model over the ranks (the seed's): attention is data-parallel (each rank attends its
own requests and holds their KV), dense layers are replicated, routed experts are spread over all
ranks when `ep == world` (the all-to-all / DeepEP dispatchers) or replicated when `ep == 1`.

Attention tensor parallelism (`tp > 1`) is run as DP attention over the same `tp * dp` ranks:
with MLA the latent KV is not sharded by heads, so TP attention would keep a copy of every
request's KV on each of its ranks; DP attention gives the same tokens with 1/tp of that KV.

Example: `serve decode --dp 16 --ep 16 --nnodes 2 --node-rank 1` -> world 16, 8 local ranks,
this node runs ranks 8..15; every rank holds 256 / 16 = 16 routed experts of V3.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.errors import UserError

DEEPEP_MODES = ("none", "normal", "low_latency", "auto")


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
        if self.collective_timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise UserError("group timeouts must be > 0")

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

    def init_host_port(self) -> tuple[str, int]:
        host, sep, port = self.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--dist-init-addr {self.dist_init_addr!r} must be HOST:PORT")
        return host.strip("[]"), int(port)

    def dispatcher(self, deepep_available: bool) -> str:
        """The EP dispatcher for this layout: `deepep` where `deep_ep` imports and a mode asks for it
        (`auto`: normal in prefill, low-latency in decode, chosen per forward by the batch's mode),
        else `all_to_all` with the same semantics; `local` without EP."""
        if self.ep == 1:
            return "local"
        if self.deepep_mode != "none" and deepep_available:
            return "deepep"
        return "all_to_all"
