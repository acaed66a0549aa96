"""KV transfer between two KV pools through the real bootstrap server and client, on loopback.

    .venv/bin/python bench/kv_transfer.py                            # grpc, CPU, V2-Lite shape, 4k tokens
    .venv/bin/python bench/kv_transfer.py --device cuda              # GPU pool -> GPU pool (one GPU), 1 vs 4 streams
    .venv/bin/python bench/kv_transfer.py --layerwise                # one send per layer, as layer-wise prefill
    .venv/bin/python bench/kv_transfer.py --transport mooncake --netns   # ours vs raw Mooncake TCP
    .venv/bin/python bench/kv_transfer.py --transport mooncake --netns --staging-tokens 2048 --no-ceiling
                                                                     # the same prompt through staging windows
    .venv/bin/python bench/kv_transfer.py --transport mooncake --netns --mooncake-direction write
                                                                     # the older direction (prefill writes)

The same classes and code path as the workers: `KVPush` (prefill) and `pull_kv` (decode) meet
in a `RoomRegistry` behind a `BootstrapServer`: handshake, chunks, TransferDone and its
confirmation. One request's pages (`--tokens`, scattered and permuted page ids on both sides)
move per repeat; the destination is compared with the source bit for bit after every repeat.
For grpc the prefill side runs in a child process (two workers, two event loops and GILs, as in
production; `--together` for one process); mooncake runs in one process, next to the raw write.

`--streams 1,4` (the default) runs the grpc transfer once per value of `TransportConfig.grpc_streams`
(parallel KV streams per room, each on its own connection) and ends with one table of all of them,
the raw gRPC ceilings and the 2 GB/s target (issue 7: one 4k-token V2-Lite request, 127 MB, pool
to pool on loopback). For the GPU: `python bench/kv_transfer.py --device cuda` (no other flag).

Printed: GB/s of each repeat (from decode's handshake to holding the KV and the TransferDone),
the longest the decode event loop was kept from running meanwhile, a breakdown of where the
chunk time went (summed over worker threads, so it can exceed the wall time), and a ceiling
measured in the same run on the same loopback: a bare gRPC stream of the same message sizes and
bytes (grpc), or raw `batch_transfer_sync_write` of the same batch between the same two engines
(mooncake, between our repeats). The ratio to it is the last line of the table.

`--json FILE` also writes the measured seconds and the target check (`bench/target_check.py`):
for grpc the best GB/s of any stream count against 2 GB/s, for mooncake ours / raw (best over
best) against 0.8. `bench/serving_gpu.py` runs this script for its one table of issue 7's targets.

Profiling: `--profile FILE` writes cProfile stats of one repeat (event-loop thread only); for the
worker threads run the bench under `py-spy record --threads --idle -f raw`.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import os
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.engine.interface import DisaggParams
from deepseek_pd.workers.transport.internal_auth import InternalAuth
from deepseek_pd.workers.transport import TransportConfig, build_receiver, build_sender
from deepseek_pd.workers.transport.base import SAME_HOST_DIRECT_MODES
from deepseek_pd.model.kv.mooncake_direction import MOONCAKE_KV_DIRECTIONS
from deepseek_pd.workers.transport.checksum import IMPLEMENTATION as CRC32_IMPLEMENTATION
from deepseek_pd.workers.transport.stats import PHASES, TransferStats
from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ceilings beside this script
from kv_transfer_ceilings import raw_grpc, raw_mooncake, raw_mooncake_read  # noqa: E402
from target_check import check  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_GBPS = 2.0  # issue 7: the gRPC KV transport, GPU pool to GPU pool on loopback, one 4k-token request
TARGET_MOONCAKE_VS_RAW = 0.8  # issue 7: Mooncake TCP through our transport / raw Mooncake TCP, same hosts


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
    parser.add_argument("--streams", default="1,4",
                        help="grpc: comma-separated grpc_streams values (parallel KV streams per room) to compare")
    parser.add_argument("--window", type=int, default=BootstrapConfig.event_queue_depth,
                        help="credit window (events in flight)")
    parser.add_argument("--layerwise", action="store_true", help="send layer by layer (layers_ready)")
    parser.add_argument("--staging-tokens", type=int, default=TransportConfig.mooncake_staging_tokens,
                        help="mooncake: decode's staging (engine option mooncake_staging_tokens); below "
                             "--tokens the prompt moves through windows of half of it (pass --no-ceiling)")
    parser.add_argument("--mooncake-direction", default=TransportConfig.mooncake_kv_direction,
                        choices=MOONCAKE_KV_DIRECTIONS,
                        help="mooncake: decode reads the KV (pull, the default) or prefill writes it (write)")
    parser.add_argument("--same-host-direct", default=TransportConfig.same_host_direct, choices=SAME_HOST_DIRECT_MODES,
                        help="grpc: device-to-device copies between same-host pools (auto: CUDA pools); "
                             "off measures the byte stream")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-ceiling", action="store_true", help="skip the raw gRPC / raw Mooncake ceiling")
    parser.add_argument("--together", action="store_true",
                        help="grpc: run both sides in this process (default: prefill in a child process, as "
                             "two workers; mooncake and fake always run together)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile one extra repeat into FILE (with --together)")
    parser.add_argument("--netns", action="store_true",
                        help="re-run inside a private network namespace (Mooncake binds 0.0.0.0)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the seconds of every repeat and the target check to FILE")
    args = parser.parse_args(argv)
    try:
        args.stream_counts = [int(v) for v in args.streams.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--streams {args.streams!r}: comma-separated integers, e.g. 1,4")
    if not args.stream_counts or min(args.stream_counts) < 1:
        parser.error("--streams needs values >= 1")
    if args.transport != "grpc":
        args.stream_counts = [1]
    return args


def reexec_in_netns(argv: list[str], script: Path = Path(__file__)) -> int:
    """Runs `script` again with `argv` less --netns in a private network namespace with loopback up."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit("--netns needs unshare and ip (scripts/system-deps.sh)")
    inner = [a for a in argv if a != "--netns"]
    command = shlex.join([sys.executable, str(script.resolve()), *inner])
    return subprocess.call(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"])


class Setup:
    """Two pools with the request's pages scattered and permuted on both sides; `seed` makes the
    source pool and page lists the same in every process that builds them (split mode)."""

    def __init__(self, args: argparse.Namespace, seed: int, with_destination: bool = True) -> None:
        self.args = args
        self.seed = seed
        dtype, device = DTYPES[args.dtype], torch.device(args.device)
        self.num_pages = -(-args.tokens // args.page_size)
        total = self.num_pages * 2 + 3
        self.src = KVPool(args.layers, total, args.page_size, args.kv_dim, dtype=dtype, device=device)
        self.dst = (KVPool(args.layers, total, args.page_size, args.kv_dim, dtype=dtype, device=device)
                    if with_destination else None)
        generator = torch.Generator(device=device).manual_seed(seed)
        for buffer in self.src.buffers:
            buffer.copy_(torch.randn(buffer.shape, generator=generator, device=device).to(dtype))
        rng = random.Random(seed)
        self.src_pages = rng.sample(range(total), self.num_pages)
        self.dst_pages = rng.sample(range(total), self.num_pages)
        # A few contiguous runs, as a fresh pool hands out, so run merging has work too.
        half = self.num_pages // 2
        self.src_pages[:half] = sorted(self.src_pages[:half])
        self.bytes = self.num_pages * self.src.bytes_per_page * args.layers

    def clear_destination(self) -> None:
        for buffer in self.dst.buffers:
            _host(buffer).fill(0) if buffer.device.type == "cpu" else buffer.zero_()
        _sync(self.dst.device)

    def exact(self) -> bool:
        _sync(self.dst.device)
        if self.dst.device.type == "cpu":  # numpy's compares: torch's fork OpenMP teams that spin on into
            return all(np.array_equal(_host(self.src.buffers[layer])[self.src_pages],  # the next repeat
                                      _host(self.dst.buffers[layer])[self.dst_pages])
                       for layer in range(self.args.layers))
        return all(torch.equal(self.src.buffers[layer][self.src_pages], self.dst.buffers[layer][self.dst_pages])
                   for layer in range(self.args.layers))


def _host(buffer: torch.Tensor) -> np.ndarray:
    """A CPU layer buffer as uint8 `[pages, page bytes]`, no copy."""
    return buffer.view(buffer.shape[0], -1).view(torch.uint8).numpy()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def configs(args: argparse.Namespace, streams: int, secret: bytes) -> tuple[TransportConfig, BootstrapConfig]:
    """Both sides' settings; `secret`: the deployment secret both processes share (split mode)."""
    return (TransportConfig(max_chunk_bytes=int(args.chunk_mb * 2**20), io_threads=args.io_threads, send_timeout_s=60,
                            grpc_streams=streams, same_host_direct=args.same_host_direct,
                            mooncake_staging_tokens=args.staging_tokens,
                            mooncake_kv_direction=args.mooncake_direction),
            BootstrapConfig(port=0, transfer_timeout_s=300, event_queue_depth=args.window,
                            auth=InternalAuth(secret=secret)))


async def push_request(setup: Setup, registry, sender, room: int) -> TransferStats:
    """The prefill side of one request, as the prefill engine drives `KVPush`."""
    args = setup.args
    push = KVPush(registry, sender, room, f"p{room}", args.tokens)
    try:
        await push.handshake(30)
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


async def pull_request(setup: Setup, receiver, client, port: int, room: int) -> tuple[float, TransferStats, float]:
    """The decode side of one request: (seconds from its handshake to holding all KV and the
    TransferDone, its stats, the longest its event loop stalled meanwhile)."""
    sinks = []
    open_sink = receiver.open_sink

    def capture(pages, peer_host=None):
        sinks.append(open_sink(pages, peer_host))
        return sinks[-1]

    receiver.open_sink = capture
    stalls: list[float] = []
    # The stall probe wakes the loop every millisecond; Mooncake's writes never touch the loop,
    # and the probe's own load would only blur the comparison with the raw write.
    ticker = asyncio.ensure_future(_loop_stalls(stalls) if setup.args.transport == "grpc" else _idle(stalls))
    try:
        began = time.perf_counter()
        await pull_kv(client, receiver, DisaggParams("127.0.0.1", port, room), f"d{room}", setup.args.tokens,
                      setup.dst_pages)
        _sync(setup.dst.device)
        elapsed = time.perf_counter() - began
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        receiver.open_sink = open_sink
    return elapsed, sinks[0].stats, stalls[0]


async def _loop_stalls(out: list[float]) -> None:
    """The longest this event loop (in split mode: only the decode side's) was late for a 1 ms
    timer: how long KV ingest keeps it from running the decode scheduler."""
    worst = 0.0
    try:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - began - 0.001)
    finally:
        out.append(worst)


async def _idle(out: list[float]) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        out.append(0.0)


class Results:
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.stalls: list[float] = []
        self.ceilings: list[float] = []  # mooncake: measured between our repeats, so both see the same load
        self.read_ceilings: list[float] = []  # mooncake: raw reads of the same pages, right after each raw write
        self.stats = TransferStats()
        self.sides = {"prefill": TransferStats(), "decode": TransferStats()}  # run_together: each side's phases
        self.cpu: list[float] = []  # run_together: the process's CPU seconds (every thread) per repeat
        self.raw_cpu: list[float] = []  # ... per raw mooncake write


async def run_together(setup: Setup, results: Results, profile: str | None, streams: int, secret: bytes) -> None:
    """Both sides in this process, on one event loop (needed for the raw Mooncake comparison)."""
    args = setup.args
    transport, bootstrap = configs(args, streams, secret)
    registry = RoomRegistry(bootstrap)
    server = BootstrapServer(registry, bootstrap, transport.max_chunk_bytes, kv_streams=streams)
    await server.start()
    sender = build_sender(args.transport, setup.src, transport)
    server.servicer.answer = sender.answer_handshake  # (as the prefill engine: a pulled transfer's source)
    receiver = build_receiver(args.transport, setup.dst, transport)
    client = BootstrapClient(bootstrap)

    async def once(room: int) -> tuple[float, TransferStats, float]:
        sent, (elapsed, received, stall) = await asyncio.gather(
            push_request(setup, registry, sender, room), pull_request(setup, receiver, client, server.port, room))
        if room > 1:  # (not the warm-up)
            results.sides["prefill"].merge(sent)
            results.sides["decode"].merge(received)
        merged = TransferStats()
        merged.merge(received)
        merged.merge(sent)
        return elapsed, merged, stall

    try:
        await once(1)  # warm-up: connections, staging buffers, first-touch of pages
        for repeat in range(args.repeats):
            setup.clear_destination()
            cpu = time.process_time()
            elapsed, stats, stall = await once(repeat + 2)
            results.cpu.append(time.process_time() - cpu)
            if not setup.exact():
                raise SystemExit(f"repeat {repeat}: destination pages differ from the source")
            results.seconds.append(elapsed)
            results.stalls.append(stall)
            results.stats.merge(stats)
            line = f"repeat {repeat}: {setup.bytes / elapsed / 1e9:.3f} GB/s ({elapsed * 1e3:.1f} ms), exact"
            if not args.no_ceiling and args.transport == "mooncake":
                cpu = time.process_time()
                results.ceilings.append(raw_mooncake(setup, sender, receiver))
                results.raw_cpu.append(time.process_time() - cpu)
                line += f"; raw {setup.bytes / results.ceilings[-1] / 1e9:.3f} GB/s ({results.ceilings[-1] * 1e3:.1f} ms)"
                results.read_ceilings.append(raw_mooncake_read(setup, sender, receiver))
                line += f", raw read {setup.bytes / results.read_ceilings[-1] / 1e9:.3f} GB/s"
            print(line, flush=True)
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await once(10_000)
            profiler.disable()
            profiler.dump_stats(profile)
            print(f"cProfile of one repeat written to {profile}")
    finally:
        await client.close()
        await server.stop(0)
        sender.close()
        receiver.close()


def _prefill_process(argv: list[str], seed: int, conn, streams: int, secret: bytes) -> None:
    """Split mode's child: the prefill worker's side, driven over a pipe (run ROOM / stop)."""
    setup = Setup(parse_args(argv), seed, with_destination=False)

    async def serve() -> None:
        transport, bootstrap = configs(setup.args, streams, secret)
        registry = RoomRegistry(bootstrap)
        server = BootstrapServer(registry, bootstrap, transport.max_chunk_bytes, kv_streams=streams)
        await server.start()
        sender = build_sender(setup.args.transport, setup.src, transport)
        server.servicer.answer = sender.answer_handshake
        loop = asyncio.get_running_loop()
        conn.send(server.port)
        try:
            while (command := await loop.run_in_executor(None, conn.recv)) != "stop":
                stats = await push_request(setup, registry, sender, command)
                conn.send((stats.seconds, stats.chunks, stats.bytes))
        finally:
            await server.stop(0)
            sender.close()

    asyncio.run(serve())


async def run_split(setup: Setup, results: Results, argv: list[str], streams: int, secret: bytes) -> None:
    """Prefill in a child process, decode here: as two workers, each with its own event loop and GIL."""
    args = setup.args
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_prefill_process, args=(argv, setup.seed, child_conn, streams, secret),
                            daemon=True)
    child.start()
    loop = asyncio.get_running_loop()
    transport, bootstrap = configs(args, streams, secret)
    receiver = build_receiver(args.transport, setup.dst, transport)
    client = BootstrapClient(bootstrap)
    try:
        port = await loop.run_in_executor(None, conn.recv)
        for repeat in range(-1, args.repeats):  # -1: warm-up
            setup.clear_destination()
            conn.send(repeat + 2)
            elapsed, stats, stall = await pull_request(setup, receiver, client, port, repeat + 2)
            seconds, chunks, nbytes = await loop.run_in_executor(None, conn.recv)
            if not setup.exact():
                raise SystemExit(f"repeat {repeat}: destination pages differ from the source")
            if repeat < 0:
                continue
            sent = TransferStats()
            sent.seconds.update(seconds)
            sent.chunks, sent.bytes = chunks, nbytes
            stats.merge(sent)
            results.seconds.append(elapsed)
            results.stalls.append(stall)
            results.stats.merge(stats)
            print(f"repeat {repeat}: {setup.bytes / elapsed / 1e9:.3f} GB/s ({elapsed * 1e3:.1f} ms), exact, "
                  f"decode event loop stalled <= {stall * 1e3:.1f} ms", flush=True)
        conn.send("stop")
    finally:
        await client.close()
        receiver.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.netns:
        raise SystemExit(reexec_in_netns(argv))
    setup = Setup(args, seed=random.randrange(1 << 30))
    secret = secrets.token_bytes(32)  # both processes of split mode sign with it, as one deployment
    split = args.transport == "grpc" and not args.together
    where = "prefill and decode in two processes" if split else "both sides in one process"
    runs: dict[int, Results] = {}
    for streams in args.stream_counts:
        results = runs[streams] = Results()
        print(f"-- {streams} KV stream(s) per room", flush=True)
        if split:
            asyncio.run(run_split(setup, results, argv, streams, secret))
        else:
            asyncio.run(run_together(setup, results, args.profile, streams, secret))
        report(setup, results, where)
    ceilings: dict[int, list[float]] = {}
    if not args.no_ceiling and args.transport == "grpc":
        for streams in sorted({1, max(args.stream_counts)}):
            ceilings[streams] = asyncio.run(raw_grpc(setup.bytes, int(args.chunk_mb * 2**20), args.repeats, streams))
    summary(setup, runs, ceilings, where)
    if args.json:
        args.json.write_text(json.dumps(result_json(setup, runs, ceilings, where), indent=2))


def result_json(setup: Setup, runs: dict[int, Results], ceilings: dict[int, list[float]], where: str) -> dict:
    """Every repeat's seconds and the one check of issue 7 that this transport answers."""
    args = setup.args
    if args.transport == "mooncake":
        ours, raw = runs[1].seconds, runs[1].ceilings
        value = min(raw) / min(ours) if raw else None
        verdict = check("Mooncake TCP: ours / raw (best)", value, ">=", TARGET_MOONCAKE_VS_RAW)
    else:
        value = max(setup.bytes / min(r.seconds) / 1e9 for r in runs.values())
        verdict = check(f"{args.transport} KV {args.device} pool -> pool, {args.tokens} tokens (GB/s)",
                        value, ">=", TARGET_GBPS)
    return {"transport": args.transport, "device": args.device, "same_host_direct": args.same_host_direct,
            "where": where, "tokens": args.tokens,
            "bytes": setup.bytes, "layerwise": args.layerwise, "crc32": CRC32_IMPLEMENTATION,
            "runs": [{"streams": s, "seconds": r.seconds, "raw_seconds": r.ceilings,
                      "raw_read_seconds": r.read_ceilings, "stalls": r.stalls, "stage_ms": stage_breakdown(r),
                      "cpu_seconds": r.cpu, "raw_cpu_seconds": r.raw_cpu}
                     for s, r in runs.items()],
            "raw_grpc": [{"connections": c, "seconds": sec} for c, sec in ceilings.items()],
            "check": verdict}


def summary(setup: Setup, runs: dict[int, Results], ceilings: dict[int, list[float]], where: str) -> None:
    """The short table printed last: each stream count, the raw ceilings, the target."""
    args = setup.args
    print()
    print(f"KV transfer summary: {args.transport} on {args.device}, {where}, {args.tokens} tokens, "
          f"{setup.bytes / 1e6:.1f} MB ({setup.src.bytes_per_token} B/token), chunk {args.chunk_mb:g} MiB, "
          f"{args.io_threads} io threads, crc32 {CRC32_IMPLEMENTATION}, same_host_direct {args.same_host_direct}"
          + (", layer-wise" if args.layerwise else ""))
    print(f"| {'what':<34} | {'best GB/s':>9} | {'median GB/s':>11} | {'best ms':>8} | {'vs ' + str(TARGET_GBPS) + ' GB/s':>11} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 13}|{'-' * 10}|{'-' * 13}|")

    def row(label: str, seconds: list[float], verdict: bool) -> None:
        best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
        rate = setup.bytes / best / 1e9
        mark = ("met" if rate >= TARGET_GBPS else f"{rate / TARGET_GBPS:.2f}x") if verdict else ""
        print(f"| {label:<34} | {rate:>9.3f} | {setup.bytes / median / 1e9:>11.3f} | {best * 1e3:>8.1f} | {mark:>11} |")

    for streams, results in runs.items():
        row(f"ours, {streams} stream(s)", results.seconds, args.transport == "grpc")
    for streams, seconds in ceilings.items():
        row(f"raw gRPC, {streams} connection(s)", seconds, False)


def stage_breakdown(results: Results) -> dict[str, dict[str, float]]:
    """Each side's mean ms per transfer in each phase it spent time in (stats.py names them:
    prefill `stage` = gather + encrypt, `mac`, `register`, `credit` = waiting for decode's reads;
    decode `network` = Mooncake's reads, `write` = decrypt + land + zero, `mac`, `check` = finite)."""
    repeats = max(1, len(results.seconds))
    return {side: {phase: seconds / repeats * 1e3 for phase, seconds in stats.seconds.items() if seconds}
            for side, stats in results.sides.items()}


def report(setup: Setup, results: Results, where: str) -> None:
    args, seconds, stats = setup.args, results.seconds, results.stats
    best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
    mode = "layer-wise" if args.layerwise else "all layers per send"
    print()
    print(f"KV transfer, transport {args.transport} on {args.device}, {mode}, {where}: {args.tokens} tokens x "
          f"{args.layers} layers x {args.kv_dim} x {setup.src.buffers[0].element_size()} B = "
          f"{setup.src.bytes_per_token} B/token, {setup.bytes / 1e6:.1f} MB, page {args.page_size}, "
          f"chunk {args.chunk_mb:g} MiB, {args.io_threads} io threads, window {args.window}")
    stalls = sorted(results.stalls)
    if args.transport == "grpc":
        print(f"decode event loop, longest stall per transfer: median {stalls[len(stalls) // 2] * 1e3:.1f} ms, "
              f"worst {stalls[-1] * 1e3:.1f} ms" + ("" if "two" in where else " (shared with prefill here)"))
    if stats.chunks:
        chunk_ms = ", ".join(f"{phase} {stats.seconds[phase] / len(seconds) * 1e3:.1f}" for phase in PHASES)
        print(f"per transfer, ms summed over threads: {chunk_ms} ({stats.chunks // (2 * len(seconds))} chunks)")
    if args.transport == "mooncake":
        if results.cpu:
            cores = len(os.sched_getaffinity(0))
            print(f"process CPU per transfer (both sides, every thread), best: ours {min(results.cpu) * 1e3:.0f} ms"
                  + (f", raw write {min(results.raw_cpu) * 1e3:.0f} ms" if results.raw_cpu else "")
                  + f"; on {cores} cores ours takes at least {min(results.cpu) / cores * 1e3:.0f} ms")
        for side, phases in stage_breakdown(results).items():
            print(f"{side}, per transfer, ms summed over threads: "
                  + ", ".join(f"{phase} {ms:.1f}" for phase, ms in phases.items()))
    print(f"| {'what':<40} | {'GB/s':>7} | {'ms':>7} |")
    print(f"|{'-' * 42}|{'-' * 9}|{'-' * 9}|")
    print(f"| {'ours, best of ' + str(len(seconds)):<40} | {setup.bytes / best / 1e9:>7.3f} | {best * 1e3:>7.1f} |")
    print(f"| {'ours, median':<40} | {setup.bytes / median / 1e9:>7.3f} | {median * 1e3:>7.1f} |")
    if results.ceilings:
        label = "raw gRPC stream, same messages" if args.transport == "grpc" else "raw batch_transfer_sync_write"
        raw_best, raw_median = min(results.ceilings), sorted(results.ceilings)[len(results.ceilings) // 2]
        print(f"| {label + ', best':<40} | {setup.bytes / raw_best / 1e9:>7.3f} | {raw_best * 1e3:>7.1f} |")
        print(f"| {label + ', median':<40} | {setup.bytes / raw_median / 1e9:>7.3f} | {raw_median * 1e3:>7.1f} |")
        print(f"| {'ours / raw (best, median)':<40} | {raw_best / best:>7.2f} | {raw_median / median:>7.2f} |")
        if results.read_ceilings:
            read_best = min(results.read_ceilings)
            print(f"| {'raw batch_transfer_sync_read, best':<40} | {setup.bytes / read_best / 1e9:>7.3f} | "
                  f"{read_best * 1e3:>7.1f} |")
        if len(results.ceilings) == len(seconds):  # measured back to back: the load changes less within a pair
            paired = sorted(raw / ours for raw, ours in zip(results.ceilings, seconds))
            print(f"| {'ours / raw, per repeat pair, median':<40} | {paired[len(paired) // 2]:>7.2f} | {'':>7} |")


if __name__ == "__main__":
    main()
