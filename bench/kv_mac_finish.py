"""How much of the mooncake KV MAC is left on the first token's path, on each side (issue 25).

    .venv/bin/python bench/kv_mac_finish.py --tiny                       # CPU, small pool
    python bench/kv_mac_finish.py --device cuda --tokens 4096 --json $OUT/kv_mac.json

The prefill side seals each mooncake transfer with a keyed MAC over every byte it sent
(workers/transport/kv_mac.py). It used to hash the whole prompt's KV at `finish`, after the first
token was sampled; now each send starts hashing its pages beside its write (`LayerMacs.update`,
from `MooncakeChannel.begin_seal`) and `finish` only digests. One V2-Lite-shaped pool (27 layers,
576-wide bf16 latent, 64-token pages) holding a `--tokens` prompt, cut as the prefill worker cuts
it (chunks of `--chunk` tokens, each sent layer by layer with `--layerwise`):
  one-shot   `kv_mac.kv_mac` over the prompt at finish: what `finish` did before;
  sends      the summed `update(...).wait()` of every send (beside its write, off the first token's path);
  last send  the last send's hash: it runs beside that send's write, which `finish` waits for, so
             at most this much of the MAC may still delay the first token beyond `digest`;
  finish     `digest` after those sends: what `finish` itself does now.
Prints (last send + finish) / one-shot against its ideal, the last send's share of the prompt's
cells (1 / the number of sends), and the tags' equality (they must be equal; the exit status says).

The decode side checks the same tag over its private copy of the KV (mooncake writes land in a
staging area, workers/transport/staging.py). It used to copy the staging into the request's pages
and MAC that copy after the TransferDone; now each send is reported once written and lands then
(copied out, then hashed: `SendLanding`, `kv_mac.LandedMacs`), so the check only digests:
  one-shot   the staging copy of every page + `kv_mac.kv_mac` of the copy + the finite check of
             every page (decode/kv_checks.py), after the done (before);
  landings   the summed copy + hash + finite check of every send as its report lands (beside the
             prefill forward);
  last       the last send's landing, which the TransferDone follows on the stream;
  check      `digest` after those landings: what the check does now.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.decode.kv_checks import check_kv_finite
from deepseek_pd.workers.transport import kv_mac
from deepseek_pd.workers.transport.staging import StagingArea


def _sends(num_pages: int, chunk_pages: int, num_layers: int, layerwise: bool) -> list[tuple[range, int, int]]:
    out = []
    for begin in range(0, num_pages, chunk_pages):
        end = min(num_pages, begin + chunk_pages)
        layers = [range(layer, layer + 1) for layer in range(num_layers)] if layerwise else [range(num_layers)]
        out.extend((each, begin, end) for each in layers)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk, in tokens")
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--layerwise", action="store_true", help="each chunk sent one layer at a time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="CPU, 8 layers, 1024 tokens layer by layer, 3 repeats")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.tiny:
        args.device, args.layers, args.tokens, args.chunk, args.repeats = "cpu", 8, 1024, 256, 3
        args.layerwise = True
    device, page_size = torch.device(args.device), 64
    num_pages = -(-args.tokens // page_size)
    pool = KVPool(args.layers, num_pages + 8, page_size, 576, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for buffer in pool.buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen, device=device))
    rng = random.Random(0)
    pages = rng.sample(range(pool.num_pages), num_pages)
    key, head = bytes(rng.randrange(256) for _ in range(kv_mac.KEY_BYTES)), kv_mac.header(1, pages)
    sends = _sends(num_pages, max(1, args.chunk // page_size), args.layers, args.layerwise)
    one_shot, sending, last, finish, equal = [], [], [], [], True
    _sync(device)
    for _ in range(args.repeats):
        began = time.perf_counter()
        whole = kv_mac.kv_mac(pool, pages, key, head)
        one_shot.append(time.perf_counter() - began)
        macs, spent = kv_mac.LayerMacs(pool.num_layers, key, head), 0.0
        for layers, begin, end in sends:
            began = time.perf_counter()
            macs.update(pool, layers, begin, pages[begin:end]).wait()
            spent += time.perf_counter() - began
        sending.append(spent)
        last.append(time.perf_counter() - began)
        began = time.perf_counter()
        equal &= macs.digest(pool, pages) == whole
        finish.append(time.perf_counter() - began)
    decode = _decode_side(pool, pages, key, head, sends, args.repeats, device)
    equal &= decode.pop("tags_equal")
    mb = num_pages * pool.num_layers * pool.bytes_per_page / 1e6
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "tokens": args.tokens, "layers": args.layers, "chunk": args.chunk, "layerwise": args.layerwise,
              "kv_mb": round(mb, 1), "one_shot_ms": statistics.median(one_shot) * 1e3,
              "sends_ms": statistics.median(sending) * 1e3,
              "last_send_ms": statistics.median(last) * 1e3, "finish_ms": statistics.median(finish) * 1e3,
              "mac_threads": kv_mac._THREADS, "tags_equal": equal}
    result["finish_over_one_shot"] = (result["last_send_ms"] + result["finish_ms"]) / result["one_shot_ms"]
    print(f"{mb:.1f} MB of KV ({args.tokens} tokens x {args.layers} layers, chunks of {args.chunk}"
          f"{', layer by layer' if args.layerwise else ''}) on {result['device']}, {kv_mac._THREADS} MAC threads:")
    print(f"  one-shot at finish (before) {result['one_shot_ms']:8.2f} ms")
    print(f"  beside the sends            {result['sends_ms']:8.2f} ms (summed over {len(sends)} sends)")
    print(f"  the last send's share       {result['last_send_ms']:8.2f} ms (beside its write)")
    print(f"  left at finish (now)        {result['finish_ms']:8.3f} ms")
    result["ideal"] = 1 / len(sends)
    print(f"(last send + finish) / one-shot = {result['finish_over_one_shot']:.4f} (ideal 1/{len(sends)} = "
          f"{result['ideal']:.4f}); tags equal: {equal}")
    result["decode"] = decode
    print("decode side (the staging copied into the request's pages, MACed and checked finite there):")
    print(f"  copy + one-shot after the done (before) {decode['one_shot_ms']:8.2f} ms")
    print(f"  landing beside the sends                {decode['landings_ms']:8.2f} ms (summed)")
    print(f"  the last send's landing                 {decode['last_landing_ms']:8.2f} ms")
    print(f"  left at the check (now)                 {decode['check_ms']:8.3f} ms")
    print(f"(last landing + check) / one-shot = {decode['check_over_one_shot']:.4f}; tags equal: {equal}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if equal else 1


def _decode_side(src: KVPool, src_pages: list[int], key: bytes, head: bytes, sends, repeats: int,
                 device: torch.device) -> dict:
    """The decode side's work on the first token's path before and after, medians in ms: `src`'s
    pages as the writer put them into a staging area, landed into another pool."""
    pool = KVPool(src.num_layers, src.num_pages, src.page_size, src.kv_dim, dtype=src.dtype, device=device)
    staging = StagingArea(pool, len(src_pages))
    slots, pages = list(range(len(src_pages))), list(range(len(src_pages)))
    index = torch.tensor(src_pages, dtype=torch.long, device=device)

    def written() -> None:  # what the prefill side's writes leave in the staging
        for staged, buffer in zip(staging.buffers, src.buffers):
            staged.copy_(buffer.index_select(0, index))
        _sync(device)
    one_shot, landings, last, check, equal = [], [], [], [], True
    for _ in range(repeats):
        written()
        began = time.perf_counter()
        staging.copy_into(pool, slots, pages)
        whole = kv_mac.kv_mac(pool, pages, key, head, synced=True)
        check_kv_finite(pool, pages, "bench")
        one_shot.append(time.perf_counter() - began)
        written()
        macs, spent = kv_mac.LandedMacs(pool, pages, key, head), 0.0
        for layers, begin, end in sends:
            began = time.perf_counter()
            staging.copy_into(pool, slots[begin:end], pages[begin:end], layers)
            macs.landed(layers, begin, end)
            check_kv_finite(pool, pages[begin:end], "bench", layers)
            spent += time.perf_counter() - began
        landings.append(spent)
        last.append(time.perf_counter() - began)
        began = time.perf_counter()
        equal &= macs.digest() == whole
        check.append(time.perf_counter() - began)
    out = {"one_shot_ms": statistics.median(one_shot) * 1e3, "landings_ms": statistics.median(landings) * 1e3,
           "last_landing_ms": statistics.median(last) * 1e3, "check_ms": statistics.median(check) * 1e3,
           "tags_equal": equal}
    out["check_over_one_shot"] = (out["last_landing_ms"] + out["check_ms"]) / out["one_shot_ms"]
    return out


if __name__ == "__main__":
    sys.exit(main())
