"""Which DP rank of a worker group holds a PD request, and where that rank's bootstrap endpoint is.

The rule (SGLang's: its decode side computes `target_dp_group = bootstrap_room % prefill_dp_size`
and asks the prefill bootstrap server for that rank's endpoint):

    dp_rank_for_room(room, dp) = room % dp

Both sides apply it: a prefill group's rank 0 hands the request of room r to DP rank r % dp (whose
engine claims the room on its own bootstrap server), a decode group puts it on its DP rank r % dp,
and a decode rank pulls its KV from the prefill rank r % prefill_dp, whose endpoint it learns from
the prefill group's `Route` reply (`RouteTable`).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.proto import bootstrap_pb2 as pb


def dp_rank_for_room(room: int, dp: int) -> int:
    """The DP rank of a PD request's bootstrap room, the same on the prefill and the decode side."""
    return room % dp


@dataclass(frozen=True)
class RankEndpoint:
    host: str  # "" for rank 0: the address the decode side dialled (the router's bootstrap address)
    port: int


@dataclass(frozen=True)
class RouteTable:
    """A prefill group's bootstrap endpoints, one per DP rank (rank 0 first)."""

    ranks: tuple[RankEndpoint, ...] = (RankEndpoint("", 0),)

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a route table lists at least rank 0")

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def endpoint_for(self, room: int, dialled: tuple[str, int]) -> tuple[str, int]:
        """(host, port) of the rank that holds `room`; rank 0 is the address that was dialled."""
        rank = self.ranks[dp_rank_for_room(room, self.dp_size)]
        return dialled if not rank.host else (rank.host, rank.port)

    def to_proto(self) -> pb.RouteReply:
        return pb.RouteReply(dp_size=self.dp_size,
                             ranks=[pb.RankEndpoint(host=r.host, port=r.port) for r in self.ranks])

    @classmethod
    def from_proto(cls, reply: pb.RouteReply) -> "RouteTable":
        """Raises ValueError for a table that does not hold together."""
        if reply.dp_size < 1 or len(reply.ranks) != reply.dp_size:
            raise ValueError(f"route table lists {len(reply.ranks)} endpoints for dp_size {reply.dp_size}")
        ranks = tuple(RankEndpoint(r.host, r.port) for r in reply.ranks)
        for dp_rank, rank in enumerate(ranks[1:], start=1):
            if not rank.host or not 0 < rank.port < 65536:
                raise ValueError(f"route table: DP rank {dp_rank} has no endpoint ({rank.host!r}:{rank.port})")
        return cls(ranks)
