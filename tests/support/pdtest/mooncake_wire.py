"""A stranger's view of Mooncake's TCP data port (0.3.13.post1), for the attack tests in a network
namespace: its raw request framing, finding a worker's data port, and where a prefill writes.

Mooncake's TCP server reads a 24-byte header per request, `{u64 size; u64 addr; u8 opcode}` (7
bytes of padding; tcp_transport_session_impl.h `SessionHeader`), checks `[addr, addr + size)`
against its registered memory once, then reads (WRITE) or sends (READ) the body, at the peer's
pace. Opcode bit 0x80 asks for protocol v2, whose 8-byte status frame ("MCTV" << 32 | code)
answers whether the range was accepted.

The attacks' common set-up is here too: a PD request whose transfer is held in flight
(`start_held_transfer`: its destination slots stay registered while the attacker writes), and
the verdict a write into them must end in (`assert_refused_by_mac`). So is the set-up of the
staging-window scripts: a PD pair whose decode side stages a given number of tokens
(`staged_pair`), a prefill whose first report waits (`hold_first_report`), and a batch
that must all equal the oracle and leave pools and staging empty (`serve_all_as_the_oracle`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
from pathlib import Path
from typing import Any, Awaitable, Callable

from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.transport.wire import ChunkView, decode_event
from deepseek_pd.workers.transport.worker_config import WorkerConfig
from pdtest.hostile_prefill import hold_transfer_done
from pdtest.pd_engine_harness import PDPair, collect, worker_config

HEADER = struct.Struct("<QQB7x")
READ, WRITE, V2 = 0, 1, 0x80
STATUS_OK = 0x4D435456 << 32


def listening_ports() -> list[int]:
    """The TCP ports something listens on in this network namespace."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        piece = sock.recv(count - len(data))
        if not piece:
            break
        data += piece
    return data


def find_data_port(addr: int, length: int) -> int:
    """The port whose Mooncake server has `[addr, addr + length)` registered now: the only one that
    answers a v2 READ of it with the OK status frame."""
    for port in listening_ports():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                sock.sendall(HEADER.pack(length, addr, READ | V2))
                frame = _recv_exactly(sock, 8)
        except OSError:
            continue
        if len(frame) == 8 and struct.unpack("<Q", frame)[0] == STATUS_OK:
            return port
    raise AssertionError(f"no listener has {length} bytes at {addr:#x} registered")


def start_write(port: int, addr: int, length: int) -> socket.socket:
    """Sends a v2 WRITE header for `[addr, addr + length)` and no body yet: the server checks the
    range now and then waits for the body (`send_bodies`), after which it answers the status frame."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    sock.sendall(HEADER.pack(length, addr, WRITE | V2))
    return sock


def record_handshakes(sender) -> dict[str, pb.Handshake]:
    """Every handshake `sender` (a prefill worker's KV sender) opens, by decode rid: where that prefill
    writes (`mooncake.layer_base_addrs[l] + page_ids[i] * page_bytes`), which a stranger learns from
    the decode engine's own handshake service."""
    seen: dict[str, pb.Handshake] = {}
    opener = sender.open

    def recording(handshake, *args, **kwargs):
        copy = pb.Handshake()
        copy.CopyFrom(handshake)
        seen[handshake.decode_rid] = copy
        return opener(handshake, *args, **kwargs)
    sender.open = recording
    return seen


def record_channels(sender) -> dict[str, Any]:
    """Every channel `sender` (a prefill worker's KV sender) opens, by decode rid (its
    `src_pages`: the prefill pool's page of each request page sent so far)."""
    seen: dict[str, Any] = {}
    opener = sender.open

    def recording(handshake, *args, **kwargs):
        seen[handshake.decode_rid] = channel = opener(handshake, *args, **kwargs)
        return channel
    sender.open = recording
    return seen


def record_reports(sender) -> dict[str, list[ChunkView]]:
    """Every report (a KVChunk without data) the channels `sender` (a prefill's KV sender) opens
    emit, by decode rid, as decode parses it: a pulled transfer's names the send-staging slots
    decode reads (`source_addr`). Records before any hold installed after it."""
    seen: dict[str, list[ChunkView]] = {}
    opener = sender.open

    def recording(handshake, emit, *args, **kwargs):
        reports = seen.setdefault(handshake.decode_rid, [])

        async def emit_recorded(chunk):
            reports.append(decode_event(chunk.payload).chunk)
            await emit(chunk)
        return opener(handshake, emit_recorded, *args, **kwargs)
    sender.open = recording
    return seen


def source_addr(sender, report: ChunkView) -> tuple[int, int]:
    """(address, bytes) of the first page, first layer, that a pulled report names in the prefill
    side's send staging (`sender`'s): where decode reads it, and a stranger may write it in flight."""
    staging = sender.staging
    return staging.base_addrs[report.layer_begin] + report.source_slots[0] * staging.page_bytes, staging.page_bytes


def write_direction(config: WorkerConfig) -> WorkerConfig:
    """`config` for a decode worker that has the prefill side write into its staging (the older
    direction, an engine option): the attacks on that direction's staging run against it."""
    return dataclasses.replace(config, transport=dataclasses.replace(config.transport, mooncake_kv_direction="write"))


METADATA_REQUEST = 1  # Mooncake's HandShakeRequestType::Metadata (common.h)


def ask_metadata(host: str, port: int) -> dict:
    """The segment descriptor a Mooncake handshake port serves for `{}`: an 8-byte length, the
    request type, JSON (common.h writeString); no credential of any kind."""
    payload = bytes([METADATA_REQUEST]) + b"{}"
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(struct.pack("<Q", len(payload)) + payload)
        reply = b""
        while len(reply) < 8 or len(reply) < 8 + struct.unpack("<Q", reply[:8])[0]:
            chunk = sock.recv(65536)
            assert chunk, f"the handshake port closed after {len(reply)} bytes"
            reply += chunk
    return json.loads(reply[9:])  # after the length and the echoed type


def first_page_addr(handshake: pb.Handshake) -> tuple[int, int]:
    """(address, bytes) of the first page of layer 0 that the handshake tells its prefill to write."""
    destination = handshake.mooncake
    return destination.layer_base_addrs[0] + handshake.page_ids[0] * destination.page_bytes, destination.page_bytes


def nan_bytes(length: int) -> bytes:
    """`length` bytes of float32 NaNs (what the attacks write: any dtype's KV read from them is NaN
    or garbage, which changes a greedy output)."""
    return struct.pack("<f", float("nan")) * (length // 4) + b"\xff" * (length % 4)


async def send_bodies(writes: list[tuple[socket.socket, int, int]], timeout_s: float = 5.0,
                      body=nan_bytes) -> None:
    """Sends bodies (`body(length)`: NaNs by default) on the started writes `(sock, addr, length)`
    and returns once the server said each one is in memory (its v2 status frame; read in a thread,
    off the event loop)."""
    def finish() -> None:
        for sock, addr, length in writes:
            sock.settimeout(timeout_s)
            sock.sendall(body(length))
            frame = _recv_exactly(sock, 8)
            assert len(frame) == 8 and struct.unpack("<Q", frame)[0] == STATUS_OK, \
                f"the late body at {addr:#x} was not applied: {frame!r}"
    await asyncio.to_thread(finish)


async def start_held_transfer(pair: PDPair, prompt: list[int], params: SamplingParams, rid: str,
                              on_decode_event: Callable[[Any], Awaitable[None]] | None = None):
    """Starts PD request `rid` on `pair` and returns once its prefill side has written KV into the
    decode side's staging that decode has not copied out yet: its first send, whose report is held
    back (with everything after it), or, without reports (a transfer in windows reports only
    those; an older peer none), every send, its TransferDone held back. The transfer stays in flight
    on the decode side (its slots registered) until the returned event is set. Returns (the
    request's gathered (prefill, decode) outcomes, to await after setting it; that event)."""
    sent, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        sent.set()
        await release.wait()
    undo_done = hold_transfer_done(pair.prefill, sent, release)
    undo_report = hold_first_report(pair.prefill.sender, hold, decode_rid=f"{rid}-d")
    p_req, d_req = pair.requests(prompt, params, rid)
    served = asyncio.gather(collect(pair.prefill, p_req), collect(pair.decode, d_req, on_decode_event))
    try:
        await asyncio.wait_for(sent.wait(), 60)
    finally:  # only this request's room holds its report or its TransferDone
        undo_report()
        undo_done()
    return served, release


def assert_refused_by_mac(outcome: Any) -> None:
    """A request whose slots a stranger wrote in flight is refused by its KV MAC (transport/kv_mac.py),
    with no output token changed."""
    assert not outcome.ok and "does not match the MAC" in outcome.terminal.message, outcome


def staged_pair(staging_tokens: int, **decode_transport: Any) -> PDPair:
    """A Mooncake PD pair (enter it with `async with`) whose decode side stages `staging_tokens`
    tokens of KV, with any other `TransportConfig` fields given for the decode side."""
    config = worker_config("mooncake")
    staged = dataclasses.replace(config, transport=dataclasses.replace(
        config.transport, mooncake_staging_tokens=staging_tokens, **decode_transport))
    return PDPair("mooncake", prefill_config=config, decode_config=staged)


def hold_first_report(sender, wait: Callable[[], Awaitable[None]], *, decode_rid: str | None = None,
                      each_channel: bool = False) -> Callable[[], None]:
    """The first report (a KVChunk without data: a window's, or a send's, since decode lands each
    send as its report comes) that `sender` (a prefill's KV sender) emits waits for `wait()` before
    it goes out, and nothing of its transfer follows meanwhile: its cells stay in decode's staging,
    not copied out. Only the channel of `decode_rid` where given; with `each_channel`, every
    channel's first report. Returns the undo (the sender's `open` back)."""
    opener = sender.open
    held: list = []

    def holding(handshake, emit, *args, **kwargs):
        if decode_rid is not None and handshake.decode_rid != decode_rid:
            return opener(handshake, emit, *args, **kwargs)
        first = [] if each_channel else held

        async def emit_held(chunk):
            if not first:
                first.append(chunk)
                await wait()
            await emit(chunk)
        return opener(handshake, emit_held, *args, **kwargs)
    sender.open = holding
    return lambda: setattr(sender, "open", opener)


async def serve_all_as_the_oracle(pair: PDPair, prompts: list[list[int]], params: SamplingParams,
                                  expected: list[list[int]]) -> None:
    """Runs every prompt on `pair` at once: each decode output must be `expected`'s, and the pools
    and decode's staging end empty."""
    outcomes = await asyncio.gather(*(pair.run(p, params, f"r{i}") for i, p in enumerate(prompts)))
    bad = [(i, d.terminal if not d.ok else d.tokens) for i, ((_, d), want) in enumerate(zip(outcomes, expected))
           if not (d.ok and d.tokens == want)]
    assert not bad, bad
    await pair.wait_pools_clean(5)
    assert pair.decode.receiver.staging.num_used == 0
