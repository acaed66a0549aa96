"""Rooms by id on the prefill worker: claims by prefill requests, handshakes by decode, tombstones.

A room serves one request: one claim (the prefill engine's Generate) and one handshake (the
decode side's Transfer stream), in either order. A room whose request ended before the other
side arrived stays as a tombstone for `claim_timeout_s`, so that late arrival fails at once
instead of waiting out its own timeout.
"""
from __future__ import annotations

import asyncio

from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.prefill.room import Room


class RoomRegistry:
    """Rooms by id; owned by the prefill engine, shared with the bootstrap servicer."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self._rooms: dict[int, Room] = {}

    def _get_or_create(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room(room_id, self.config.event_queue_depth)
        return room

    def claim(self, room_id: int, rid: str) -> Room:
        """The prefill engine takes the room for request `rid`; a room serves one request."""
        room = self._get_or_create(room_id)
        if room.claimed.done():
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"bootstrap room {room_id} is already used by request {room.prefill_rid}")
        room.prefill_rid = rid
        room.claimed.set_result(rid)
        room.met()
        return room

    def attach(self, handshake: pb.Handshake) -> Room:
        """The decode side's handshake for its room arrived."""
        room = self._get_or_create(handshake.room)
        if room.handshake.done():
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"bootstrap room {handshake.room} already has a decode handshake")
        room.handshake.set_result(handshake)
        room.met()
        return room

    def abort(self, room_id: int, reason: str) -> bool:
        """The decode side gave up on the room. If prefill has not claimed it yet, a tombstone
        stays for `claim_timeout_s` so that a late Generate fails at once instead of waiting."""
        found = room_id in self._rooms
        room = self._get_or_create(room_id)
        room.mark_peer_gone(FailureCode.ABORTED, f"decode side aborted room {room_id}: {reason}")
        if not room.claimed.done():
            self._keep_as_tombstone(room)
        return found

    def release(self, room: Room) -> None:
        """The prefill request is over. If it failed before decode's handshake came, the room
        stays as a tombstone for `claim_timeout_s` so that handshake gets the failure at once."""
        if not room.handshake.done() and room.failure.done() and not room.tombstone:
            self._keep_as_tombstone(room)
        else:
            self.drop(room)

    def drop(self, room: Room) -> None:
        if self._rooms.get(room.room_id) is room:
            del self._rooms[room.room_id]

    def _keep_as_tombstone(self, room: Room) -> None:
        room.tombstone = True
        asyncio.get_running_loop().call_later(self.config.claim_timeout_s, self.drop, room)

    @property
    def num_active(self) -> int:
        """Rooms of requests in progress (tombstones excluded)."""
        return sum(1 for room in self._rooms.values() if not room.tombstone)

    def get(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

    def __len__(self) -> int:
        return len(self._rooms)
