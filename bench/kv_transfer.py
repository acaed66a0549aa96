"""KV transfer between two KV pools through the real bootstrap server and client, on loopback.

    .venv/bin/python bench/kv_transfer.py                            # grpc, CPU, V2-Lite shape, 4k tokens
    .venv/bin/python bench/kv_transfer.py --device cuda              # GPU pool -> GPU pool (one GPU)
    .venv/bin/python bench/kv_transfer.py --layerwise                # one send per layer, as layer-wise prefill
    .venv/bin/python bench/kv_transfer.py --transport mooncake --netns   # ours vs raw Mooncake TCP

The same classes and code path as the workers: `KVPush` (prefill) and `pull_kv` (decode) meet
in a `RoomRegistry` behind a `BootstrapServer`: handshake, chunks, TransferDone and its
confirmation. One request's pages (`--tokens`, scattered and permuted page ids on both sides)
move per repeat; the destination is compared with the source bit for bit after every repeat.

Printed: GB/s of each repeat (from the handshake's acceptance to decode's TransferDone), the
best, a breakdown of where the chunk time went (summed over worker threads, so it can exceed the
wall time), and a ceiling measured in the same run on the same loopback: a bare gRPC stream of
the same message sizes and bytes (grpc), or raw `batch_transfer_sync_write` of the same batch
between the same two engines (mooncake). The ratio to it is the last line of the table.

Profiling: `--profile FILE` writes cProfile stats of one repeat (event-loop thread only); for the
worker threads run the bench under `py-spy record --threads --idle -f raw`.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from deepseek_pd.model.kv_pool import KVPool
from deepseek_pd.workers.common.api import DisaggParams
from deepseek_pd.workers.common.kv_transfer import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.common.kv_transfer.stats import PHASES, TransferStats
from deepseek_pd.workers.common.worker_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="grpc", choices=["grpc", "mooncake", "fake"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (both pools on it)")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the one request")
    parser.add_argument("--layers", type=int, default=27, help="default: DeepSeek-V2-Lite")
    parser.add_argument("--kv-dim", type=int, default=576, help="kv_lora_rank + qk_rope_head_dim")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--chunk-mb", type=float, default=TransportConfig.max_chunk_bytes / 2**20,
                        help="grpc: max KV bytes per message (MiB)")
    parser.add_argument("--io-threads", type=int, default=TransportConfig.io_threads)
    parser.add_argument("--window", type=int, default=BootstrapConfig.event_queue_depth,
                        help="credit window (events in flight)")
    parser.add_argument("--layerwise", action="store_true", help="send layer by layer (layers_ready)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-ceiling", action="store_true", help="skip the raw gRPC / raw Mooncake ceiling")
    parser.add_argument("--ceiling-streams", type=int, default=1,
                        help="grpc: also measure the raw ceiling over this many parallel streams (own connections)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile one extra repeat into FILE")
    parser.add_argument("--netns", action="store_true",
                        help="re-run inside a private network namespace (Mooncake binds 0.0.0.0)")
    return parser.parse_args(argv)


def reexec_in_netns(argv: list[str]) -> int:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("--netns needs unshare and ip (scripts/system-deps.sh)")
    inner = [a for a in argv if a != "--netns"]
    command = " ".join([sys.executable, str(Path(__file__).resolve()), *inner])
    return subprocess.call(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"])


class Setup:
    """Two pools with the request's pages scattered and permuted on both sides."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        dtype, device = DTYPES[args.dtype], torch.device(args.device)
        self.num_pages = -(-args.tokens // args.page_size)
        total = self.num_pages * 2 + 3
        self.src = KVPool(args.layers, total, args.page_size, args.kv_dim, dtype=dtype, device=device)
        self.dst = KVPool(args.layers, total, args.page_size, args.kv_dim, dtype=dtype, device=device)
        generator = torch.Generator(device=device).manual_seed(random.randrange(1 << 30))
        for buffer in self.src.buffers:
            buffer.copy_(torch.randn(buffer.shape, generator=generator, device=device).to(dtype))
        rng = random.Random()
        self.src_pages = rng.sample(range(total), self.num_pages)
        self.dst_pages = rng.sample(range(total), self.num_pages)
        # A few contiguous runs, as a fresh pool hands out, so run merging has work too.
        half = self.num_pages // 2
        self.src_pages[:half] = sorted(self.src_pages[:half])
        self.bytes = self.num_pages * self.src.bytes_per_page * args.layers

    def clear_destination(self) -> None:
        for buffer in self.dst.buffers:
            buffer.zero_()

    def exact(self) -> bool:
        return all(torch.equal(self.src.buffers[layer][self.src_pages], self.dst.buffers[layer][self.dst_pages])
                   for layer in range(self.args.layers))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def transfer_once(setup: Setup, registry, server, sender, receiver, client, room: int
                        ) -> tuple[float, TransferStats, TransferStats]:
    """One request's transfer; returns (seconds from accepted handshake to TransferDone, send stats, receive stats)."""
    args = setup.args
    sinks = []
    open_sink = receiver.open_sink

    def capture(pages):
        sinks.append(open_sink(pages))
        return sinks[-1]

    receiver.open_sink = capture
    began: list[float] = []

    async def prefill() -> TransferStats:
        push = KVPush(registry, sender, room, f"p{room}", args.tokens)
        try:
            await push.handshake(10)
            _sync(setup.src.device)
            began.append(time.perf_counter())
            if args.layerwise:
                for layer in range(args.layers):
                    event = None
                    if setup.src.device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record()
                    push.layers_ready(args.tokens, setup.src_pages, layer, layer + 1, event)
                    await asyncio.sleep(0)
            else:
                push.pages_ready(args.tokens, setup.src_pages)
            await push.finish(first_token_id=1, logprob=0.0, cached_tokens=0)
            return push.channel.stats
        finally:
            push.close()

    ended: list[float] = []

    async def decode() -> None:
        await pull_kv(client, receiver, DisaggParams("127.0.0.1", server.port, room), f"d{room}", args.tokens,
                      setup.dst_pages)
        _sync(setup.dst.device)
        ended.append(time.perf_counter())  # decode holds all the KV and the TransferDone: it may decode

    ticker = asyncio.ensure_future(_loop_stalls(STALLS))
    try:
        send_stats, _ = await asyncio.gather(prefill(), decode())
    finally:
        ticker.cancel()
        receiver.open_sink = open_sink
    return ended[0] - began[0], send_stats, sinks[0].stats


STALLS: list[float] = []  # the longest the event loop was late for a 1 ms timer, per transfer


async def _loop_stalls(out: list[float]) -> None:
    """How long the event loop (which runs both sides here, and the decode scheduler in a worker)
    stays busy between two turns while KV streams through it."""
    worst = 0.0
    try:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - began - 0.001)
    finally:
        out.append(worst)


async def run_ours(setup: Setup, profile: str | None) -> tuple[list[float], TransferStats, list[float]]:
    args = setup.args
    transport = TransportConfig(max_chunk_bytes=int(args.chunk_mb * 2**20), io_threads=args.io_threads,
                                send_timeout_s=60)
    bootstrap = BootstrapConfig(port=0, transfer_timeout_s=300, event_queue_depth=args.window)
    registry = RoomRegistry(bootstrap)
    server = BootstrapServer(registry, bootstrap, transport.max_chunk_bytes)
    await server.start()
    sender = build_sender(args.transport, setup.src, transport)
    receiver = build_receiver(args.transport, setup.dst, transport)
    client = BootstrapClient(bootstrap)
    seconds: list[float] = []
    ceilings: list[float] = []  # mooncake: measured between our repeats, so both see the same load
    stats = TransferStats()
    try:
        await transfer_once(setup, registry, server, sender, receiver, client, room=1)  # warm-up
        for repeat in range(args.repeats):
            setup.clear_destination()
            _sync(setup.dst.device)
            elapsed, send_stats, receive_stats = await transfer_once(
                setup, registry, server, sender, receiver, client, room=repeat + 2)
            _sync(setup.dst.device)
            if not setup.exact():
                raise SystemExit(f"repeat {repeat}: destination pages differ from the source")
            seconds.append(elapsed)
            stats.merge(send_stats)
            stats.merge(receive_stats)
            line = f"repeat {repeat}: {setup.bytes / elapsed / 1e9:.3f} GB/s ({elapsed * 1e3:.1f} ms), exact"
            if not args.no_ceiling and args.transport == "mooncake":
                ceilings.append(raw_mooncake(setup, sender, receiver))
                line += f"; raw {setup.bytes / ceilings[-1] / 1e9:.3f} GB/s ({ceilings[-1] * 1e3:.1f} ms)"
            print(line)
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await transfer_once(setup, registry, server, sender, receiver, client, room=10_000)
            profiler.disable()
            profiler.dump_stats(profile)
            print(f"cProfile of one repeat written to {profile}")
    finally:
        await client.close()
        await server.stop(0)
        sender.close()
        receiver.close()
    if not args.no_ceiling and args.transport == "grpc":
        ceilings = await raw_grpc(setup.bytes, transport.max_chunk_bytes, args.repeats)
        if args.ceiling_streams > 1:
            parallel = await raw_grpc(setup.bytes, transport.max_chunk_bytes, args.repeats, args.ceiling_streams)
            print(f"raw gRPC over {args.ceiling_streams} parallel streams: best "
                  f"{setup.bytes / min(parallel) / 1e9:.3f} GB/s (one stream: {setup.bytes / min(ceilings) / 1e9:.3f})")
    return seconds, stats, ceilings


async def raw_grpc(total_bytes: int, message_bytes: int, repeats: int, streams: int = 1) -> list[float]:
    """Seconds to stream `total_bytes` as bare `bytes` messages over `streams` loopback gRPC streams,
    each on its own connection (what parallel KV streams could reach)."""
    import grpc

    payload = os.urandom(message_bytes)
    count = -(-total_bytes // message_bytes // streams)

    async def stream(request_iterator, context):
        await request_iterator.__anext__()
        for _ in range(count):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Raw", {"S": grpc.stream_stream_rpc_method_handler(stream)})
    limit = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    server = grpc.aio.server(options=limit)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=limit + [("grpc.use_local_subchannel_pool", 1)])
                for _ in range(streams)]

    async def one(channel) -> None:
        call = channel.stream_stream("/bench.Raw/S")()
        await call.write(b"go")
        while await call.read() is not grpc.aio.EOF:
            pass

    seconds: list[float] = []
    try:
        for _ in range(repeats + 1):
            began = time.perf_counter()
            await asyncio.gather(*(one(channel) for channel in channels))
            seconds.append(time.perf_counter() - began)
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)
    return seconds[1:]  # the first one connects


def raw_mooncake(setup: Setup, sender, receiver) -> float:
    """Seconds of one raw `batch_transfer_sync_write` of the same batch between the same two engines."""
    from deepseek_pd.workers.common.kv_transfer.mooncake import build_write_batch

    batch = build_write_batch(sender.engine.base_addrs, receiver.engine.base_addrs, setup.src.bytes_per_page,
                              setup.src_pages, setup.dst_pages)
    began = time.perf_counter()
    status = sender.engine.engine.batch_transfer_sync_write(receiver.engine.session_id, *batch)
    elapsed = time.perf_counter() - began
    if status != 0:
        raise SystemExit(f"raw mooncake write failed with status {status}")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.netns:
        raise SystemExit(reexec_in_netns(argv))
    setup = Setup(args)
    seconds, stats, ceilings = asyncio.run(run_ours(setup, args.profile))
    best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
    mode = "layer-wise" if args.layerwise else "all layers per send"
    print()
    print(f"KV transfer, transport {args.transport} on {args.device}, {mode}: {args.tokens} tokens x "
          f"{args.layers} layers x {args.kv_dim} x {setup.src.buffers[0].element_size()} B = "
          f"{setup.src.bytes_per_token} B/token, {setup.bytes / 1e6:.1f} MB, page {args.page_size}, "
          f"chunk {args.chunk_mb:g} MiB, {args.io_threads} io threads, window {args.window}")
    stalls = sorted(STALLS[1:])  # without the warm-up
    if stalls:
        print(f"event loop (both sides): longest stall per transfer, median {stalls[len(stalls) // 2] * 1e3:.1f} ms, "
              f"worst {stalls[-1] * 1e3:.1f} ms")
    if stats.chunks:
        chunk_ms = ", ".join(f"{phase} {stats.seconds[phase] / len(seconds) * 1e3:.1f}" for phase in PHASES)
        print(f"per transfer, ms summed over threads: {chunk_ms} ({stats.chunks // (2 * len(seconds))} chunks)")
    print(f"| {'what':<40} | {'GB/s':>7} | {'ms':>7} |")
    print(f"|{'-' * 42}|{'-' * 9}|{'-' * 9}|")
    print(f"| {'ours, best of ' + str(len(seconds)):<40} | {setup.bytes / best / 1e9:>7.3f} | {best * 1e3:>7.1f} |")
    print(f"| {'ours, median':<40} | {setup.bytes / median / 1e9:>7.3f} | {median * 1e3:>7.1f} |")
    if ceilings:
        label = "raw gRPC stream, same messages" if args.transport == "grpc" else "raw batch_transfer_sync_write"
        raw_best, raw_median = min(ceilings), sorted(ceilings)[len(ceilings) // 2]
        print(f"| {label + ', best':<40} | {setup.bytes / raw_best / 1e9:>7.3f} | {raw_best * 1e3:>7.1f} |")
        print(f"| {label + ', median':<40} | {setup.bytes / raw_median / 1e9:>7.3f} | {raw_median * 1e3:>7.1f} |")
        print(f"| {'ours / raw (best, median)':<40} | {raw_best / best:>7.2f} | {raw_median / median:>7.2f} |")


if __name__ == "__main__":
    main()
