"""Bursts of concurrent streams through the real gateway (smg) under each load-balancing policy.

    python bench/gateway_burst.py                        # 1000 streams x 1 burst x 4 policies
    python bench/gateway_burst.py --streams 200 --bursts 3 --policies round_robin,cache_aware

For each policy one `deepseek-pd up --policy P` (exactly what users run) serves `--bursts` bursts
in a row of `--streams` concurrent streamed `/generate` requests (greedy, `ignore_eos`, a fixed
budget). Prompts come from a few shared prefixes plus a random tail, so `cache_aware`'s radix tree
gets real insertions and matches — the tree that deadlocked sglang-router 0.3.2 (FACTS).

Every stream ends as exactly one of:
- completed: HTTP 200, exactly `--max-new-tokens` tokens, finish reason "length";
- failed: an HTTP error, an error event, or the wrong number of tokens (a lost or duplicated piece);
- hung: no end within `--hang-after-s` (the stream is then cancelled).
After each burst the router must still answer `/liveness`, and every worker's KV pool must be
back to zero (GetLoads) within `--drain-s`. The last thing printed is one table, a row per policy:
completed / failed / hung over all its bursts, TTFT p50 / p99 of the completed streams, the prefix
cache hit rate (the prefill workers' cached / prompt tokens, from each answer's meta_info: what
`cache_aware` is for, with more than one prefill worker), and whether the router stayed live and
the pools drained. `--json` also writes every row and the config.

On a 2-core CPU use a small N (`--streams 200`); the tiny model keeps the workers cheap, so what
is measured is mostly the gateway and the PD handshake under a burst.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")
# The shapes the end-to-end tests use: small pages and prefill chunks, so modest prompts cross them.
CPU_WORKER_ARGS = ("--page-size=4", "--chunked-prefill-size=32", "--num-pages=8192", "--drain-timeout=2")


@dataclass(frozen=True)
class BurstConfig:
    streams: int = 1000
    bursts: int = 1
    max_new_tokens: int = 8
    prompt_len: tuple[int, int] = (8, 64)  # tokens, inclusive range
    prefixes: int = 8  # shared prompt prefixes (cache_aware's tree gets branches and hits)
    hang_after_s: float = 300.0
    drain_s: float = 30.0
    seed: int = 0


@dataclass
class Outcome:
    status: str  # "completed" | "failed" | "hung"
    ttft_s: float | None = None
    detail: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefill worker found in its radix cache


@dataclass
class PolicyRow:
    policy: str
    streams: int = 0
    completed: int = 0
    failed: int = 0
    hung: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    wall_s: float = 0.0
    cache_hit_pct: float | None = None  # cached / prompt tokens over completed streams
    router_live: bool = True
    pools_drained: bool = True
    errors: dict[str, int] = field(default_factory=dict)  # first words of each failure, counted
    note: str = ""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def burst_prompts(config: BurstConfig, vocab: int, rng: random.Random) -> list[list[int]]:
    low, high = config.prompt_len
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randint(low // 2, max(low // 2, low)))]
                for _ in range(config.prefixes)]
    prompts = []
    for _ in range(config.streams):
        prefix = rng.choice(prefixes)
        tail = max(1, rng.randint(low, high) - len(prefix))
        prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(tail)])
    return prompts


async def one_stream(session, url: str, model: str, prompt: list[int], config: BurstConfig) -> Outcome:
    from deepseek_pd.client.sse import iter_sse_json

    body = {"model": model, "input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": config.max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    start = time.perf_counter()
    ttft = None
    tokens = 0
    reason = None
    meta: dict = {}
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            return Outcome("failed", detail=f"HTTP {response.status}: {(await response.text())[:120]}")
        async for event in iter_sse_json(response):
            if event.get("error"):
                return Outcome("failed", detail=f"error event: {str(event['error'])[:120]}")
            ids = event.get("output_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += len(ids)
            meta = event.get("meta_info") or meta
            reason = (meta.get("finish_reason") or {})
            reason = reason.get("type") if isinstance(reason, dict) else reason
    if tokens != config.max_new_tokens or reason != "length":
        return Outcome("failed", ttft, f"{tokens} tokens, finish {reason!r} (want {config.max_new_tokens}, 'length')")
    return Outcome("completed", ttft, prompt_tokens=int(meta.get("prompt_tokens") or 0),
                   cached_tokens=int(meta.get("cached_tokens") or 0))


async def guarded(coro, hang_after_s: float) -> Outcome:
    try:
        return await asyncio.wait_for(coro, hang_after_s)
    except asyncio.TimeoutError:
        return Outcome("hung", detail=f"no end within {hang_after_s:.0f}s")
    except Exception as exc:  # a dropped connection is a failure of that stream, not of the run
        return Outcome("failed", detail=f"{type(exc).__name__}: {exc}"[:120])


async def router_live(url: str) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{url}/liveness") as response:
                return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def pools_drained(worker_addresses: list[str], drain_s: float) -> bool:
    from deepseek_pd.client.scheduler_grpc import SchedulerClient

    deadline = time.monotonic() + drain_s
    while True:
        used = 0
        for address in worker_addresses:
            async with SchedulerClient(address) as client:
                load = await client.loads()
            used += load.num_used_tokens + load.num_running_reqs + load.num_waiting_reqs
        if used == 0:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


async def run_bursts(url: str, model: str, workers: list[str], vocab: int, config: BurstConfig,
                     row: PolicyRow) -> None:
    import aiohttp

    rng = random.Random(config.seed)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)  # every stream in flight at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for burst in range(config.bursts):
            prompts = burst_prompts(config, vocab, rng)
            outcomes = await asyncio.gather(*(guarded(one_stream(session, url, model, p, config),
                                                      config.hang_after_s) for p in prompts))
            for outcome in outcomes:
                row.streams += 1
                setattr(row, outcome.status, getattr(row, outcome.status) + 1)
                if outcome.status == "completed" and outcome.ttft_s is not None:
                    ttfts.append(outcome.ttft_s)
                    prompt_tokens += outcome.prompt_tokens
                    cached_tokens += outcome.cached_tokens
                if outcome.detail:
                    key = outcome.detail[:60]
                    row.errors[key] = row.errors.get(key, 0) + 1
            live = await router_live(url)
            drained = await pools_drained(workers, config.drain_s) if live else False
            row.router_live &= live
            row.pools_drained &= drained
            print(f"  burst {burst + 1}/{config.bursts}: "
                  f"{sum(o.status == 'completed' for o in outcomes)} completed, "
                  f"{sum(o.status == 'failed' for o in outcomes)} failed, "
                  f"{sum(o.status == 'hung' for o in outcomes)} hung; router live {live}, "
                  f"pools drained {drained}", file=sys.stderr, flush=True)
            if not live:
                row.note = f"router stopped answering after burst {burst + 1}"
                break
    row.wall_s = time.perf_counter() - started
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    row.ttft_p50_ms = None if p50 is None else p50 * 1000
    row.ttft_p99_ms = None if p99 is None else p99 * 1000
    row.cache_hit_pct = 100 * cached_tokens / prompt_tokens if prompt_tokens else None


def worker_addresses(log_dir: Path, url: str) -> list[str]:
    """The workers' gRPC addresses, from the gateway's /workers (locked by `up`'s control-plane key)."""
    import urllib.request

    key = (log_dir / "control-plane-key").read_text().strip()
    request = urllib.request.Request(f"{url}/workers", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        listing = json.loads(reply.read())
    entries = listing.get("workers", listing) if isinstance(listing, dict) else listing
    return sorted({str(w.get("url", "")).removeprefix("grpc://") for w in entries if w.get("url")})


def served_model(url: str) -> str:
    """The served model's name, from the gateway's /v1/models."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as reply:
        models = json.loads(reply.read())
    return models["data"][0]["id"]


def measure_policy(policy: str, args: argparse.Namespace, config: BurstConfig, out_dir: Path) -> PolicyRow:
    from up_process import UpProcess, UpSpec

    row = PolicyRow(policy)
    spec = UpSpec(model_dir=Path(args.model), log_dir=out_dir / policy, worker_args=tuple(args.worker_arg),
                  num_prefill=args.prefill, num_decode=args.decode, startup_timeout_s=args.startup_timeout,
                  up_args=("--policy", policy, "--device", args.device))
    print(f"policy {policy}: starting up ({args.prefill}P{args.decode}D)", file=sys.stderr, flush=True)
    try:
        with UpProcess(spec) as up:
            assert up.url is not None
            model = served_model(up.url)
            workers = worker_addresses(spec.log_dir, up.url)
            asyncio.run(run_bursts(up.url, model, workers, args.vocab, config, row))
    except (RuntimeError, OSError) as exc:
        row.note = f"could not run: {exc}"[:200]
        row.router_live = row.pools_drained = False
    return row


def format_table(rows: list[PolicyRow], config: BurstConfig) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    lines = [f"{config.bursts} burst(s) x {config.streams} concurrent streams, {config.max_new_tokens} "
             f"tokens each, prompts {config.prompt_len[0]}-{config.prompt_len[1]} tokens",
             "| policy | streams | completed | failed | hung | TTFT p50 ms | TTFT p99 ms | wall s "
             "| prefix cache hit | router live | pools drained |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.policy} | {r.streams} | {r.completed} | {r.failed} | {r.hung} | {ms(r.ttft_p50_ms)} "
                     f"| {ms(r.ttft_p99_ms)} | {r.wall_s:.1f} "
                     f"| {'-' if r.cache_hit_pct is None else f'{r.cache_hit_pct:.0f}%'} | {'yes' if r.router_live else 'NO'} "
                     f"| {'yes' if r.pools_drained else 'NO'} |")
    for r in rows:
        for detail, count in sorted(r.errors.items(), key=lambda kv: -kv[1])[:3]:
            lines.append(f"  {r.policy}: {count} x {detail}")
        if r.note:
            lines.append(f"  {r.policy}: {r.note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams per burst (default 1000)")
    parser.add_argument("--bursts", type=int, default=1, help="bursts in a row per policy (default 1)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all four)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", default="8-64", help="prompt tokens, LOW-HIGH (default 8-64)")
    parser.add_argument("--hang-after-s", type=float, default=300.0,
                        help="a stream not ended by then counts as hung (default 300)")
    parser.add_argument("--drain-s", type=float, default=30.0, help="time for KV pools to reach zero after a burst")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker-arg", action="append", default=None,
                        help="a `serve` flag for every worker (repeatable); default: the CPU test shapes")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.worker_arg is None:
        args.worker_arg = list(CPU_WORKER_ARGS)
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown or args.streams < 1 or args.bursts < 1:
        parser.error(f"bad --policies {unknown} / --streams / --bursts")
    return args


def config_from_args(args: argparse.Namespace) -> BurstConfig:
    low, _, high = args.prompt_len.partition("-")
    return BurstConfig(streams=args.streams, bursts=args.bursts, max_new_tokens=args.max_new_tokens,
                       prompt_len=(int(low), int(high or low)), hang_after_s=args.hang_after_s,
                       drain_s=args.drain_s, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from_args(args)
    out_dir = Path(tempfile.mkdtemp(prefix="gateway-burst-"))
    rows = [measure_policy(policy, args, config, out_dir) for policy in args.policies.split(",")]
    if args.json:
        args.json.write_text(json.dumps({"config": asdict(config), "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"logs in {out_dir}", file=sys.stderr)
    print(format_table(rows, config))
    ok = all(r.streams and r.completed == r.streams and r.router_live and r.pools_drained for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
