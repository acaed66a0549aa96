"""Which prefill rank a decode worker pulls a room's KV from (multi-rank prefill groups).

The router names one bootstrap address per prefill worker: its rank 0. A prefill group with DP
ranks keeps each request's KV on DP rank `room % dp` (workers/transport/bootstrap_routes.py), and
each rank has its own bootstrap endpoint. As SGLang's decode side does, we ask the named
address for the group's table (`Bootstrap.Route`), cache it, and dial the room's rank:

    route = await routes.route(channel, "10.0.0.5", 8998, room)  # route.address, route.dp_rank

- The request is signed with the deployment secret and the reply must be signed back, bound to
  the request's nonce: an endpoint is dialled only if the deployment's prefill worker named it
  (the address the router named was checked against `--prefill-peers` before any of this).
- A server that does not know `Route` (UNIMPLEMENTED: an older or single-rank worker) is one rank.
- Tables are cached for `ttl_s` (a group that restarts gets new follower ports; its restart takes
  far longer than that) and dropped at once when a routed rank cannot be reached (`invalidate`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.transport.bootstrap_protocol import target
from deepseek_pd.workers.transport.bootstrap_routes import RankRoute, RouteTable
from deepseek_pd.workers.transport.internal_auth import AuthError, InternalAuth
from deepseek_pd.workers.transport.base import TransferError

ROUTE_METHOD = "/deepseek_pd.pd.v1.Bootstrap/Route"


class RouteUnavailable(Exception):
    """The bootstrap address did not answer (yet): the caller retries as for a handshake."""


@dataclass
class _Cached:
    table: RouteTable
    fetched_at: float


class PrefillRoutes:
    def __init__(self, auth: InternalAuth, identity: str, ttl_s: float = 5.0, timeout_s: float = 5.0) -> None:
        self.auth = auth
        self.identity = identity
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._tables: dict[tuple[str, int], _Cached] = {}

    def cached(self, host: str, port: int, room: int, any_age: bool = False) -> RankRoute | None:
        """The room's rank from the cached table (fresh only, unless `any_age`), or None."""
        entry = self._tables.get((host, port))
        if entry is None or (not any_age and time.monotonic() - entry.fetched_at > self.ttl_s):
            return None
        return entry.table.route_for(room, (host, port))

    async def route(self, channel: grpc.aio.Channel, host: str, port: int, room: int) -> RankRoute:
        """The prefill rank holding `room`; raises RouteUnavailable or TransferError."""
        hit = self.cached(host, port, room)
        if hit is not None:
            return hit
        table = await self._fetch(channel, host, port)
        self._tables[(host, port)] = _Cached(table, time.monotonic())
        return table.route_for(room, (host, port))

    def invalidate(self, host: str, port: int) -> None:
        self._tables.pop((host, port), None)

    async def _fetch(self, channel: grpc.aio.Channel, host: str, port: int) -> RouteTable:
        address = target(host, port)
        request = pb.RouteRequest()
        self.auth.sign(request, "route", self.identity, address)
        call = channel.unary_unary(ROUTE_METHOD, request_serializer=pb.RouteRequest.SerializeToString,
                                   response_deserializer=pb.RouteReply.FromString)
        try:
            reply = await call(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return RouteTable()
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RouteUnavailable(exc.details() or exc.code().name) from None
            raise TransferError(FailureCode.INTERNAL, f"bootstrap {address} refused the route request: "
                                f"{exc.code().name} {exc.details()}") from None
        try:
            self.auth.verify(reply, "route", challenge=request.auth.nonce)
            return RouteTable.from_proto(reply)
        except AuthError as exc:
            raise TransferError(FailureCode.INTERNAL, f"bootstrap {address} is not this deployment's prefill "
                                f"worker (route reply: {exc})") from None
        except ValueError as exc:
            raise TransferError(FailureCode.INTERNAL, f"bootstrap {address}: {exc}") from None
