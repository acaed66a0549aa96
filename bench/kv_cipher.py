"""What the mooncake KV cipher costs (workers/transport/kv_cipher.py), per side, on one prompt.

    .venv/bin/python bench/kv_cipher.py --tiny                               # CPU, small pool
    .venv/bin/python bench/kv_cipher.py                                      # CPU, a 4k-token V2-Lite prompt
    python bench/kv_cipher.py --device cuda --json $OUT/kv_cipher.json       # GPU: the Triton kernel

Each side runs the cipher once per byte of the prompt's KV: the prefill side as it stages each send
(`StagingArea.fill_from`), the decode side as it lands it (`StagingArea.copy_into`). One
V2-Lite-shaped pool (27 layers, 576-wide bf16 latent, `--page-size`-token pages) holds a `--tokens`
prompt at shuffled pages; the staging takes it in consecutive slots, as a transfer does:
  plain      the staging copy with no cipher (what the landing cost before);
  cipher     the same copy through the cipher (CPU: `cryptography`'s ChaCha20 in `PIECE_BYTES`
             pieces, one thread; CUDA: the Triton kernel on the copy's side stream);
  GIL        (CPU) while the cipher runs in one thread, the longest another Python thread that
             wakes every 0.5 ms waits (`cryptography` holds the GIL per piece; the copy yields it
             between pieces), against the same thread's longest wait while nothing runs.
Prints GB/s (bytes of KV ciphered per second) and ms per prompt per side; checks the round trip
(encrypted by `fill_from`, decrypted by `copy_into`: the pages come back; the exit status says).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.transport.kv_cipher import CellCipher
from deepseek_pd.workers.transport.staging import StagingArea


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(work, device: torch.device, repeats: int) -> float:
    """The best wall time of `repeats` runs of `work`, seconds."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        work()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _longest_wait(work) -> float:
    """The longest gap, in seconds, between the wake-ups of a thread that sleeps 0.5 ms, while `work` runs."""
    gaps: list[float] = []
    running = threading.Event()
    running.set()

    def tick() -> None:
        last = time.perf_counter()
        while running.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    try:
        work()
    finally:
        running.clear()
        ticker.join()
    return max(gaps[1:], default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="4 layers, 512 tokens: a quick CPU check")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.tokens = 4, 512
    device = torch.device(args.device)
    rng = random.Random(0)
    num_pages = -(-args.tokens // args.page_size)
    pool = KVPool(args.layers, 2 * num_pages, args.page_size, 576, dtype=torch.bfloat16, device=device)
    for buffer in pool.buffers:
        buffer.normal_()
    pages = rng.sample(range(pool.num_pages), num_pages)
    out = KVPool(args.layers, 2 * num_pages, args.page_size, 576, dtype=torch.bfloat16, device=device)
    out_pages = rng.sample(range(out.num_pages), num_pages)
    staging = StagingArea(pool, num_pages)
    slots = list(range(num_pages))
    cipher = CellCipher(bytes(range(32)), pool.bytes_per_page, device)
    layers = range(pool.num_layers)
    total = num_pages * pool.bytes_per_page * pool.num_layers

    plain = _timed(lambda: staging.copy_into(out, slots, out_pages), device, args.repeats)
    encrypt = _timed(lambda: staging.fill_from(pool, layers, pages, slots, cipher), device, args.repeats)
    decrypt = _timed(lambda: staging.copy_into(out, slots, out_pages, None, cipher), device, args.repeats)
    staging.fill_from(pool, layers, pages, slots, cipher)
    staging.copy_into(out, slots, out_pages, None, cipher)
    round_trip = all(torch.equal(a[pages], b[out_pages]) for a, b in zip(pool.buffers, out.buffers))
    report = {"device": str(device), "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "tokens": args.tokens, "layers": args.layers, "page_size": args.page_size, "kv_mb": total / 1e6,
              "plain_copy_ms": plain * 1e3, "encrypt_ms": encrypt * 1e3, "decrypt_ms": decrypt * 1e3,
              "encrypt_gbps": total / encrypt / 1e9, "decrypt_gbps": total / decrypt / 1e9, "round_trip": round_trip}
    if device.type == "cpu":
        report["gil_wait_idle_ms"] = _longest_wait(lambda: time.sleep(0.3)) * 1e3
        report["gil_wait_cipher_ms"] = _longest_wait(
            lambda: staging.fill_from(pool, layers, pages, slots, cipher)) * 1e3
    print(f"{report['kv_mb']:.1f} MB of KV ({args.tokens} tokens x {args.layers} layers) on {report['card']}: "
          f"plain copy {report['plain_copy_ms']:.1f} ms; encrypt (prefill) {report['encrypt_ms']:.1f} ms "
          f"({report['encrypt_gbps']:.2f} GB/s), decrypt (decode) {report['decrypt_ms']:.1f} ms "
          f"({report['decrypt_gbps']:.2f} GB/s); round trip {'ok' if round_trip else 'WRONG'}")
    if device.type == "cpu":
        print(f"another thread's longest wait: {report['gil_wait_cipher_ms']:.2f} ms while the cipher runs, "
              f"{report['gil_wait_idle_ms']:.2f} ms idle")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if round_trip else 1


if __name__ == "__main__":
    sys.exit(main())
