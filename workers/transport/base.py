"""The KV transport contract: how the prefill side's latent KV pages reach the decode side's pool.

Roles (after vLLM's `KVConnectorBase_V1`, which splits a connector into a scheduler side that
decides *what* moves and a worker side that moves bytes):

- **Scheduler side** (`SendPlan`, pure bookkeeping, no I/O): the prefill scheduler tells it how
  many prompt tokens are computed after each chunk; it answers which request-local pages are now
  complete and may be sent, and, when the prompt is done, the last partial page. The decode
  scheduler allocates the destination pages before the handshake.
- **Worker side** (`KVSender` / `SendChannel` on prefill, `KVReceiver` / `KVSink` on decode):
  moves the bytes of pages `[page_begin, page_end)` of every layer from the prefill pool to the
  decode pool. How depends on the transport; the caller never branches on it.

A transfer of one request, with page_size=4 and a 10-token prompt in chunks of 8 and 2 tokens:

    decode:  pages = pool.alloc(3)            -> [7, 2, 9]; handshake carries them + destination
    prefill: channel = sender.open(handshake, room.emit_chunk)
             chunk 1 computed (8 tokens)       -> plan.ready(8) = range(0, 2); channel.send([p0, p1], 0)
             chunk 2 computed (10 tokens)      -> plan.ready(10, final=True) = range(2, 3)
             channel.send([p2], 2); then the TransferDone on the bootstrap stream
    decode:  sink.on_chunk(...) for each KVChunk (grpc only); sink.check_complete(done)

Layer-wise: the prefill forward may hand over each layer as soon as it has written it,
`channel.send([p0, p1], 0, layer_begin=l, layer_end=l + 1, ready=event)`, so the copy overlaps
the remaining layers; the decode side checks that every (layer, page) cell arrived exactly once.

Page i of the request on one side maps to page i on the other (the same request-local layout,
docs/architecture.md), so a transfer is "page index range x layer range" and contiguous page-id
runs on both sides merge into one copy.

Errors are `TransferError` (workers/engine/request_failure.py) with the `FailureCode` the request
must end with; a sink may also hold a `RequestAborted` (the transfer ended because the request did).
"""
from __future__ import annotations

import abc
import dataclasses
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol, Sequence

from deepseek_pd.bounds import bounds_blocker
from deepseek_pd.choices import not_one_of
from deepseek_pd.model.kv.page_size import different_pages_hint
from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.model.kv.mooncake_direction import MOONCAKE_KV_DIRECTIONS
from deepseek_pd.model.kv.same_host_direct import SAME_HOST_DIRECT_MODES
from deepseek_pd.model.kv.staging_size import DEFAULT_STAGING_TOKENS
from deepseek_pd.proto import bootstrap_pb2 as pb
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.transfer_limits import TRANSPORT_BOUNDS
from deepseek_pd.workers.transport.exposure import PageExposure
from deepseek_pd.workers.transport.stats import TransferStats
from deepseek_pd.workers.engine.request_failure import RequestFailure, TransferError

if TYPE_CHECKING:
    import torch

    from deepseek_pd.workers.transport.wire import EncodedChunk


@dataclass(frozen=True)
class TransportConfig:
    """Settings shared by every transport; each reads only what it needs."""

    # grpc: the most KV data in one KVChunk; both ends raise gRPC's message caps to fit it, and
    # the smaller of the two ends' values wins (the handshake carries decode's).
    max_chunk_bytes: int = 4 << 20
    io_threads: int = 4  # grpc: threads that gather+checksum (prefill) or check+write (decode) chunks
    # grpc: parallel KV streams per room, each on its own connection (the Transfer stream is one);
    # the smaller of both ends' values is used. Each send is cut into one block per stream.
    grpc_streams: int = 1
    # grpc: same-host peers copy KV device to device instead of streaming its bytes (direct_pool.py;
    # the modes: model/kv/same_host_direct.py).
    same_host_direct: str = "auto"
    send_timeout_s: float = 30.0  # one send() (a chunk's pages) may take at most this long
    advertise_host: str = "127.0.0.1"  # mooncake: the address peers reach this worker's engine at
    mooncake_protocol: str = "tcp"  # "tcp" or "rdma"
    mooncake_device: str = ""  # this process's engine: RDMA device names, "" = all
    # A group's: what each local rank's engine gets (rdma_devices.devices_per_local_rank); () = the
    # same `mooncake_device` on every rank. `for_local_rank` picks one.
    mooncake_rank_devices: tuple[str, ...] = ()
    # mooncake: log `exposure_warning` when the engine starts. A group's ranks on one node share its
    # interfaces, so only the node's first rank says it (`for_local_rank`); serve sets it, no option does.
    warn_exposure: bool = True
    # mooncake: the staging area one-sided writers write into on decode (staging.py), in tokens of KV
    # (rounded up to pages, at most the pool's); every transfer in flight holds its prompt's pages of
    # it, and a prompt longer than all of it moves through half of it in windows. On the pool's
    # device, beside the pool, and kept out of the pool's memory budget (model/kv/staging_size.py). Over
    # RDMA the prefill side sends through one of the same size (its NIC reads only registered memory).
    mooncake_staging_tokens: int = DEFAULT_STAGING_TOKENS
    # mooncake, the decode side's choice (the prefill side serves either): "pull" reads the KV out of
    # the prefill worker's send staging, "write" lets the prefill worker write into decode's staging
    # (model/kv/mooncake_direction.py says when to pick which).
    mooncake_kv_direction: str = "pull"

    def __post_init__(self) -> None:
        if (blocker := bounds_blocker(TRANSPORT_BOUNDS, **{name: getattr(self, name)
                                                           for name in TRANSPORT_BOUNDS})) is not None:
            raise ValueError(blocker)
        if (blocker := not_one_of("same_host_direct", self.same_host_direct, SAME_HOST_DIRECT_MODES)) is not None:
            raise ValueError(blocker)
        if (blocker := not_one_of("mooncake_kv_direction", self.mooncake_kv_direction,
                                  MOONCAKE_KV_DIRECTIONS)) is not None:
            raise ValueError(blocker)
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake_protocol must be tcp or rdma, got {self.mooncake_protocol!r}")
        if self.mooncake_rank_devices and self.mooncake_device not in self.mooncake_rank_devices:
            raise ValueError(f"mooncake_device {self.mooncake_device!r} is none of the local ranks' "
                             f"{self.mooncake_rank_devices}")

    def for_local_rank(self, local_rank: int) -> "TransportConfig":
        """This config as local rank `local_rank` of a group runs it: its own RDMA devices, and the
        exposure warning from local rank 0 only."""
        device = self.mooncake_rank_devices[local_rank] if self.mooncake_rank_devices else self.mooncake_device
        return dataclasses.replace(self, mooncake_device=device, warn_exposure=local_rank == 0)


# Queues one encoded KV chunk on the room's stream `chunk.stream` (grpc only), waiting for room
# (flow control); raises a RequestFailure once the decode side is gone. A channel numbers the chunks
# of each stream 1, 2, 3, ... (on the Transfer stream seq 0 is the HandshakeAck) and emits each
# stream's in that order: the stream checks it.
EmitChunk = Callable[["EncodedChunk"], Awaitable[None]]
# Waits until the decode side reports request pages 0 .. n-1 landed (copied out of its staging),
# at most `timeout_s`; raises a RequestFailure (prefill/room.py Room.wait_landed). Mooncake windows.
WaitLanded = Callable[[int, float], Awaitable[None]]
# Waits until decode credits event `seq` of the Transfer stream, at most `timeout_s`; raises a
# RequestFailure (prefill/room.py Room.wait_credited). Pulled mooncake chunks: read, so their slots free.
WaitCredited = Callable[[int, float], Awaitable[None]]


class SendChannel(abc.ABC):
    """Prefill worker side of one request's transfer, opened from the decode side's handshake."""

    # Whether handing each layer over as the forward writes it (layer-wise streaming) pays on this
    # channel: it does where moving a chunk takes a real share of computing it (bytes over a
    # network or a socket). A channel that moves a whole chunk in about a millisecond says no: its
    # per-layer hand-offs between threads would cost the forward more than they hide.
    streams_layers: bool = True
    # How to wait for decode's landed pages, which a channel writing through decode's staging in
    # windows needs (mooncake): the prefill side's KV push gives it its room's after `open`.
    wait_landed: WaitLanded | None = None
    # How to wait until decode read a reported chunk (pulled mooncake transfers keep its slots until
    # then): the prefill side's KV push gives it its room's after `open`.
    wait_credited: WaitCredited | None = None

    def __init__(self, pool: KVPool, dst_pages: Sequence[int]) -> None:
        self.pool = pool
        self.dst_pages = list(dst_pages)
        self.bytes_sent = 0
        self.stats = TransferStats()

    @abc.abstractmethod
    async def send(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                   layer_end: int | None = None, ready: "torch.cuda.Event | None" = None) -> None:
        """Copies request-local pages `page_begin .. page_begin+len(src_pages)-1` of layers
        `[layer_begin, layer_end)` (default: all layers).

        `src_pages` are this pool's page ids of those pages. `ready` (CUDA pools): an event
        recorded after those layers' KV was written; the read waits for it (without one, for
        the default stream). Returns when the bytes are in the decode pool (mooncake, fake) or
        queued on the stream in order (grpc). Raises TransferError.
        """

    def _check_range(self, src_pages: Sequence[int], page_begin: int, layer_begin: int = 0,
                     layer_end: int | None = None) -> range:
        """The layers to send; raises TransferError on pages or layers outside the request."""
        if page_begin < 0 or page_begin + len(src_pages) > len(self.dst_pages):
            raise TransferError(FailureCode.INTERNAL,
                                f"pages [{page_begin}, {page_begin + len(src_pages)}) are outside the "
                                f"{len(self.dst_pages)} pages the decode side allocated")
        end = self.pool.num_layers if layer_end is None else layer_end
        if not 0 <= layer_begin < end <= self.pool.num_layers:
            raise TransferError(FailureCode.INTERNAL,
                                f"layers [{layer_begin}, {end}) are outside the model's {self.pool.num_layers}")
        return range(layer_begin, end)

    def begin_cipher(self, algorithm: str, key: bytes) -> None:
        """Before the first send: every KV cell this channel writes is encrypted with `algorithm`
        under `key` (the handshake's decode side offered it: kv_cipher.py). Transports that
        negotiate no cipher refuse (their ack names none, so this is never asked of them)."""
        raise TransferError(FailureCode.INTERNAL, f"the {type(self).__name__} transport encrypts no KV")

    def begin_seal(self, key: bytes, room: int) -> None:
        """Before the first send: the transfer will be sealed with `key` (`seal`), so the channel may
        build its proof as the pages go out rather than all at once at the end. Nothing by default."""

    def seal_reads(self) -> bool:
        """Whether `seal` still has KV to read (then it runs in a worker thread); False: it is quick
        enough for the event loop (nothing to prove, or only a digest of what the sends hashed)."""
        return False

    def seal(self, done: pb.TransferDone, key: bytes, room: int) -> None:
        """After the last send (in a worker thread when `seal_reads`): adds to `done` (signed after this) the proof of the
        bytes sent that the decode side checks in `KVSink.check_sealed` (mooncake: a keyed MAC,
        kv_mac.py). `key`: the transfer's one-time key. Nothing by default."""

    def close(self) -> None:
        """Releases per-request resources; idempotent."""


class KVSender(abc.ABC):
    """Prefill worker side of a transport: one per worker, bound to its KV pool."""

    name: str

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        self.pool = pool
        self.config = config

    def open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int = 1) -> SendChannel:
        """Checks the handshake against this pool and transport; `emit` queues a chunk on the stream.

        `streams`: the room's KV streams (grpc; as its HandshakeAck announced), which `emit` serves."""
        check_layout(self.pool, handshake.layout)
        kind = handshake.WhichOneof("destination")
        if kind != self.name:
            raise TransferError(FailureCode.INVALID_ARGUMENT,
                                f"decode side uses KV transport {kind!r}, this prefill worker {self.name!r}")
        return self._open(handshake, emit, streams)

    @abc.abstractmethod
    def _open(self, handshake: pb.Handshake, emit: EmitChunk, streams: int) -> SendChannel: ...

    def answer_handshake(self, handshake: pb.Handshake, ack: pb.HandshakeAck) -> None:
        """Adds this transport's answer to the ack of `handshake`, before it is signed (a pulled
        mooncake transfer: the send staging decode reads from). Nothing by default."""

    async def prepare(self, handshake: pb.Handshake) -> None:
        """Does the slow part of `open` for this handshake off the event loop, so `open` (called on
        it) is quick: the grpc sender maps an offered same-host pool here. Nothing by default."""

    def close(self) -> None:
        """Releases the worker's transport resources; idempotent."""


class LandingCheck(Protocol):
    """What the decode side checks of each part of a transfer's KV as it lands (its finite check,
    decode/kv_checks.py); each raises TransferError to refuse the transfer."""

    def data(self, layers: range, data: memoryview) -> None:
        """A chunk's bytes (`[layer][page][slot][dim]` of the pool's dtype, for `layers`), before
        they are written into any page."""

    def pages(self, layers: range, pages: list[int]) -> None:
        """The pool's `pages` of `layers` hold landed KV now (written by the peer or copied out of
        a staging), which nothing reads before this check."""


class KVSink(abc.ABC):
    """Decode worker side of one request's transfer.

    Once failed (`fail`, or a chunk refused), it stays failed: later chunks are refused and
    `check_complete` raises the first error, so a partial KV is never taken as complete.
    `exposure` says whether the pages may hold bytes of this transfer (exposure.py).
    """

    # Where the bootstrap client runs `on_chunk` (a worker pool: off the event loop); None: inline.
    executor: Executor | None = None
    # The peer writes the pages itself (fake, same-host direct); a sink that writes them itself (grpc's
    # byte stream, mooncake's copy out of its staging) says False.
    one_sided: bool = True
    # `reserve` (on the loop: mooncake waits for staging slots) then `expose` make the transfer's
    # destination reachable by the transport for its duration (mooncake over TCP registers the
    # slots); `expose` may block for a while: the caller runs it off the event loop.
    registers_pages: bool = False
    # Credit each chunk as soon as it is written, not every half window: the sender waits for that
    # credit to free what the chunk held (a pulled mooncake chunk's send-staging slots).
    credits_each_chunk: bool = False

    def __init__(self, pool: KVPool, pages: Sequence[int]) -> None:
        self.pool = pool
        self.pages = list(pages)
        self.stats = TransferStats()
        self.exposure = PageExposure(self.one_sided)
        self._failed: RequestFailure | None = None
        self._fail_lock = threading.Lock()

    @property
    def failed(self) -> RequestFailure | None:
        """The first error of this transfer; its pages hold no usable KV then."""
        return self._failed

    def fail(self, error: RequestFailure) -> RequestFailure:
        """Marks the transfer failed (the first error wins) and returns the error to raise."""
        with self._fail_lock:
            if self._failed is None:
                self._failed = error
            return self._failed

    async def reserve(self, timeout_s: float | None = None) -> None:
        """Before `expose`, on the event loop: waits for what the transfer's writer needs (mooncake: its
        staging slots), at most `timeout_s` (None: the transport's own bound); cancellable. Nothing
        by default."""

    def expose(self) -> None:
        """Before the handshake: lets the transport's writer reach these pages (nothing by default)."""

    def withdraw(self) -> None:
        """Once the transfer is over, whatever its outcome: undoes `expose`; idempotent."""

    def land(self) -> None:
        """After the sender's TransferDone, in a worker thread, before any check of the KV: ends the
        writer's reach (`withdraw`) and makes what it delivered the pages' content (mooncake: copies the
        staging slots into the pages, staging.py), so nothing written later reaches what is checked."""
        self.withdraw()

    def accept_answer(self, ack: pb.HandshakeAck) -> None:
        """The signed ack's answer to what `offer_into` and the receiver's destination offered (a
        pulled mooncake transfer: where to read); raises TransferError (failing the sink) when it
        does not answer. Nothing by default."""

    def offer_into(self, handshake: pb.Handshake) -> None:
        """Adds to the handshake what this transfer offers its writer beyond the transport's
        destination (the grpc sink: its pool for same-host direct writes); nothing by default."""

    @property
    def landed_pages(self) -> int:
        """Request pages whose KV is in their own pages already, mid-transfer (mooncake windows: the
        bootstrap client reports it in its credits, and the writer then reuses their slots); 0 by default."""
        return 0

    def on_chunk(self, chunk: pb.KVChunk) -> None:
        """Writes a chunk that arrived on the bootstrap stream; only the grpc transport gets any (and
        mooncake's windows, their reports without data).

        May run in `executor`'s threads, several chunks at once.
        """
        raise self.fail(TransferError(FailureCode.INTERNAL,
                                      f"{type(self).__name__} got a KV chunk on the bootstrap stream; the "
                                      "prefill side uses another transport"))

    def check_complete(self, done: pb.TransferDone) -> None:
        """Raises TransferError if the transfer failed or the prefill side's report does not cover
        every page, or (`bytes_sent`) not every (layer, page) cell exactly once, however the sends
        were cut (per chunk, per layer range)."""
        if self._failed is not None:
            raise self._failed
        if done.num_pages != len(self.pages):
            raise self.fail(TransferError(FailureCode.INTERNAL, f"prefill reports {done.num_pages} pages "
                                          f"written, decode allocated {len(self.pages)}"))
        self._check_cells()
        expected = len(self.pages) * self.pool.num_layers * self.pool.bytes_per_page
        if done.bytes_sent != expected:
            raise self.fail(TransferError(FailureCode.INTERNAL, f"prefill reports {done.bytes_sent} bytes of KV "
                                          f"sent, {len(self.pages)} pages x {self.pool.num_layers} layers are "
                                          f"{expected}"))

    def _check_cells(self) -> None:
        """Transports that see every chunk (grpc) check here that each cell arrived."""

    def begin_cipher(self, algorithm: str, key: bytes) -> None:
        """Once the handshake is accepted, before any KV lands: the sender encrypts every cell with
        `algorithm` under `key` (its ack says so), so the sink decrypts as it lands them. Transports
        that offer no cipher refuse."""
        raise self.fail(TransferError(FailureCode.INTERNAL, f"the {type(self).__name__} transport decrypts no KV"))

    def begin_check(self, key: bytes | None, room: int, algorithm: str = "") -> None:
        """Once the handshake is accepted, before any chunk: the transfer will be checked with `key`
        (`check_sealed`) by `algorithm` (the MAC the signed ack agreed: kv_mac.agreed; "" none), so
        the sink may build its proof as the KV lands rather than all at once after the TransferDone
        (mooncake: the MAC of each landed send). Nothing by default."""

    def check_on_landing(self, check: "LandingCheck") -> None:
        """Before the transfer: `check` (decode's finite check) may run on each part of the KV as it
        lands, off the first token's path. A sink whose transfer has a MAC (mooncake) keeps the first
        refusal in `landing_failure`, reported after the MAC's verdict; one without (grpc) fails the
        transfer at once. Not run by default (`checked_on_landing` False: the caller checks after
        the TransferDone)."""

    def checked_on_landing(self) -> bool:
        """After a complete transfer: whether `check_on_landing`'s check ran on every cell."""
        return False

    # The first refusal of `check_on_landing`'s check (read once `checked_on_landing`).
    landing_failure: RequestFailure | None = None

    def check_reads(self) -> bool:
        """Whether `check_sealed` still has KV to read (then it runs in a worker thread); False: it
        is quick enough for the event loop (nothing to check, or a digest of what landed)."""
        return False

    def check_sealed(self, done: pb.TransferDone, key: bytes | None, room: int) -> None:
        """Once no writer can reach the pages any more (after `withdraw`), in a worker thread: raises
        TransferError unless the pages hold what the sender's `SendChannel.seal` proved it sent.
        `key`: the transfer's one-time key (None: insecure, nothing to check). Nothing by default:
        transports whose receiver writes every byte itself check each chunk instead."""


class KVReceiver(abc.ABC):
    """Decode worker side of a transport: one per worker, bound to its KV pool."""

    name: str

    def __init__(self, pool: KVPool, config: TransportConfig) -> None:
        self.pool = pool
        self.config = config

    @abc.abstractmethod
    def fill_destination(self, handshake: pb.Handshake) -> None:
        """Sets the handshake's `destination` oneof: where and how the prefill side writes."""

    def open_sink(self, pages: Sequence[int], peer_host: str | None = None) -> KVSink:
        """The sink of one transfer into `pages`; `peer_host`: the prefill bootstrap host it will dial
        (None: not known), for transports whose offer depends on where the writer is."""
        return KVSink(self.pool, pages)

    @property
    def late_write_grace_s(self) -> float:
        """After a failed transfer, how long a one-sided peer may still write into its pages.

        Read only for a transfer whose sink's `exposure.late_writes` says such a write is possible
        (a one-sided transport whose peer was told the pages): the grpc transport's same-host direct
        copies need the send timeout, the in-process fake none (its writes cannot outlive the test's
        failure). Mooncake's writers reach only its staging, which cools its own slots (staging.py).
        """
        return 0.0

    def close(self) -> None:
        """Releases the worker's transport resources; idempotent."""


def layout_of(pool: KVPool) -> pb.KVLayout:
    return pb.KVLayout(num_layers=pool.num_layers, page_size=pool.page_size, kv_dim=pool.kv_dim,
                       dtype=str(pool.dtype).removeprefix("torch."))


def check_layout(pool: KVPool, remote: pb.KVLayout) -> None:
    """Both sides must hold the same model's KV in the same dtype and page size."""
    local = layout_of(pool)
    if local != remote:
        def show(layout: pb.KVLayout) -> str:
            return (f"layers={layout.num_layers} page_size={layout.page_size} "
                    f"kv_dim={layout.kv_dim} dtype={layout.dtype}")
        # One layer more on one side only: the MTP layer's KV (speculative decoding on one side).
        hint = (" (one side holds the MTP layer's KV: give prefill and decode the same --speculative-num-steps, "
                "both 0 or both > 0)" if abs(local.num_layers - remote.num_layers) == 1 else "")
        if local.page_size != remote.page_size:  # the transfer moves whole pages: it does not re-page
            hint += f" ({different_pages_hint(local.page_size, remote.page_size)})"
        raise TransferError(FailureCode.INVALID_ARGUMENT,
                            f"KV layout mismatch: decode has {show(remote)}, prefill has {show(local)}{hint}")


def check_page_ids(page_ids: Sequence[int], pool_pages: int) -> None:
    """A handshake's destination pages for a writer into the decode pool (one-sided transports):
    each below the pool's size and none twice; raises TransferError."""
    if not pool_pages:
        raise TransferError(FailureCode.INVALID_ARGUMENT, "decode handshake does not say how many pages its "
                            "pool has (an older decode worker?)")
    bad = [page for page in page_ids if page >= pool_pages]
    if bad:
        raise TransferError(FailureCode.INVALID_ARGUMENT, f"decode pages {bad[:4]} are outside its "
                            f"{pool_pages}-page pool")
    if len(set(page_ids)) != len(page_ids):
        raise TransferError(FailureCode.INVALID_ARGUMENT, "decode handshake lists a page twice")
