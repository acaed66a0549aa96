"""Seconds spent per phase of moving KV, summed over chunks (threads may overlap, so the sum of
phases can exceed the wall time). Logged per request and printed by bench/kv_transfer.py."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("slot_wait", "stage", "checksum", "serialise", "network", "check", "write", "mac", "register", "credit")


class TransferStats:
    """`slot_wait`: a chunk waiting for a free staging slot; `stage`: pool -> staging (gather,
    D2H, the copy stream's sync); `checksum`: crc32 on send; `serialise`: the message
    bytes; `network`: waiting for the stream (queue, credits, HTTP/2); `check`: ranges and crc32 on
    receive; `write`: received bytes -> pool (H2D, index_copy_).

    Mooncake's phases (one-sided: the bytes never pass through Python): `stage`: pool -> send
    staging, encrypted in the same pass; `mac`: the KV MAC's hashing, summed over its threads;
    `register`: the staging's (un)registration over TCP; `credit`: prefill waiting for decode to
    have read a piece; `network`: Mooncake's batch read or write; `write`: staging -> the request's
    pages, decrypted in the same pass, slots zeroed; `check`: the finite check of what landed."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.chunks = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - began)

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.chunks += 1
            self.bytes += nbytes

    def merge(self, other: "TransferStats") -> None:
        with self._lock:
            for phase, seconds in other.seconds.items():
                self.seconds[phase] += seconds
            self.chunks += other.chunks
            self.bytes += other.bytes

    def summary(self) -> str:
        parts = " ".join(f"{phase}={seconds * 1e3:.1f}ms" for phase, seconds in self.seconds.items() if seconds)
        return f"{self.chunks} chunks, {self.bytes} bytes: {parts}"
