"""Which DP rank of a worker group holds a PD request, and where that rank's bootstrap endpoint is.

The rule (SGLang's: its decode side computes `target_dp_group = bootstrap_room % prefill_dp_size`
and asks the prefill bootstrap server for that rank's endpoint):

    dp_rank_for_room(room, dp) = room % dp

Both sides apply it: a prefill group's rank 0 hands the request of room r to DP rank r % dp (whose
engine claims the room on its own bootstrap server), a decode group puts it on its DP rank r % dp,
and a decode rank pulls its KV from the prefill rank r % prefill_dp, whose endpoint it learns from
the prefill group's `Route` reply (`RouteTable`). The handshake says which ranks it routed the
room between (`Handshake.prefill_dp_rank/_size`, `decode_dp_rank`), and a prefill rank refuses at
once a room that is not its own (`misroute_reason`), rather than waiting out its claim timeout.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepseek_pd.proto import bootstrap_pb2 as pb


def dp_rank_for_room(room: int, dp: int) -> int:
    """The DP rank of a PD request's bootstrap room, the same on the prefill and the decode side."""
    return room % dp


def misroute_reason(room: int, dp_rank: int, dp_size: int, handshake: pb.Handshake) -> str | None:
    """Why prefill DP rank `dp_rank` of `dp_size` must refuse `handshake`, or None if the room is its own.

    Example (prefill dp 2): room 6 belongs to DP rank 0. Rank 1 refuses it ("room 6 belongs to
    prefill DP rank 0 of 2 ..."), and so does rank 0 when the decode side says it routed the room
    with a one-rank table (it dialled a follower's or a restarted group's endpoint as rank 0).
    """
    owner = dp_rank_for_room(room, dp_size)
    stated = handshake.prefill_dp_size > 0  # 0: an older decode peer that states no ranks
    if owner == dp_rank and (not stated or (handshake.prefill_dp_rank, handshake.prefill_dp_size) == (dp_rank, dp_size)):
        return None
    routed = (f"decode DP rank {handshake.decode_dp_rank} routed it to prefill DP rank "
              f"{handshake.prefill_dp_rank} of {handshake.prefill_dp_size}" if stated else
              "the decode side did not say which rank it routed it to")
    return (f"misrouted handshake: room {room} belongs to prefill DP rank {owner} of {dp_size} (room % {dp_size}), "
            f"but this is prefill DP rank {dp_rank}; {routed} (a stale route table, or a bootstrap address "
            f"that names another rank than the group's rank 0)")


@dataclass(frozen=True)
class RankRoute:
    """Where a room's KV is: prefill DP rank `dp_rank` of `dp_size`, at `address`."""

    host: str
    port: int
    dp_rank: int
    dp_size: int

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


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

    def route_for(self, room: int, dialled: tuple[str, int]) -> RankRoute:
        """The rank that holds `room`; rank 0 is the address that was dialled."""
        dp_rank = dp_rank_for_room(room, self.dp_size)
        rank = self.ranks[dp_rank]
        return RankRoute(*(dialled if not rank.host else (rank.host, rank.port)), dp_rank, self.dp_size)

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
