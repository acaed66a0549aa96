"""`deepseek-pd bench serving`: load the router with streamed requests and report TTFT/TPOT/ITL.

Without --url it starts a local cluster first (the same flags as `deepseek-pd up`) and stops it
afterwards, so `deepseek-pd bench serving --num-prompts 50` is a complete benchmark by itself. With --direct
the requests skip the router and go to prefill/decode pairs over gRPC, which shows the router's cost.

Either way the workload's vocabulary and context and the reported KV bytes per token are the
served model's, as the router reports its workers (`deepseek_pd.loadgen.target_model`); with --url,
`--model DIR` only overrides them. A gateway one does not administer (no --admin-key-file) is loaded
through its client API alone: its tokenizer (or --tokenizer) gives the prompt ids, and the report
says which worker-only figures it left out (`deepseek_pd.loadgen.client_api_model`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from deepseek_pd.commands.up import add_cluster_arguments, cluster_spec_from_args
from deepseek_pd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    kinds = parser.add_subparsers(dest="bench_kind", required=True, metavar="KIND")
    serving = kinds.add_parser(
        "serving", help="load generator against the router (TTFT/TPOT/ITL, throughput, goodput)",
        description="Load the router with streamed requests and report TTFT/TPOT/ITL, throughput and "
                    "goodput. With --url the vocabulary, context and KV bytes per token are the served "
                    "model's, read from the router's /v1/models and /workers; --model DIR overrides "
                    "them; without --admin-key-file (a gateway you do not administer) its tokenizer "
                    "(/v1/tokenize, or --tokenizer) gives the prompt ids and the workers' figures are "
                    "left out. Without --url a local cluster is started (flags as `up`).")
    serving.add_argument("--url", default=None,
                         help="router URL; without it a local cluster is started (flags as `up`)")
    serving.add_argument("--model-name", default=None,
                         help="'model' field of requests (default: the router's first model)")
    serving.add_argument("--dataset", choices=["random", "fixed"], default="random")
    serving.add_argument("--num-prompts", type=int, default=100)
    serving.add_argument("--input-len", type=int, default=256)
    serving.add_argument("--output-len", type=int, default=64)
    serving.add_argument("--range-ratio", type=float, default=0.5,
                         help="random dataset: lengths are drawn from [len*(1-ratio), len]")
    serving.add_argument("--output-range-ratio", type=float, default=None,
                         help="random dataset: the same for output lengths only (default: "
                              "--range-ratio; 0: every request decodes exactly --output-len)")
    serving.add_argument("--request-rate", type=float, default=float("inf"),
                         help="Poisson arrival rate in req/s (default inf: all at once)")
    serving.add_argument("--max-concurrency", type=int, default=None,
                         help="at most this many requests in flight")
    serving.add_argument("--seed", type=int, default=0)
    serving.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    serving.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    serving.add_argument("--output-json", type=Path, default=Path("bench-serving.json"))
    serving.add_argument("--output-png", type=Path, default=Path("bench-serving.png"))
    serving.add_argument("--no-progress", action="store_true", help="no progress bar")
    serving.add_argument("--request-timeout", type=float, default=600.0)
    serving.add_argument("--admin-key-file", type=Path, default=None,
                         help="with --url: the gateway's control-plane key (read /workers); `deepseek-pd "
                              "up` writes it to <log dir>/control-plane-key")
    serving.add_argument("--tokenizer", default=None,
                         help="with --url and no --admin-key-file: the served model's tokenizer (a directory "
                              "with tokenizer.json, the file, or a hub id); default: the gateway's own, "
                              "through its /v1/tokenize")
    serving.add_argument("--worker-metrics-url", action="append", default=[], metavar="URL",
                         help="a decode rank's /metrics (repeatable; with --url): the report then carries "
                              "speculative decoding's accept length, drafted and accepted tokens when the "
                              "workers export them (the local cluster's are found by themselves)")
    serving.add_argument("--direct", action="store_true",
                         help="skip the router: dispatch each request to a prefill/decode pair of "
                              "the local cluster over gRPC (shows what the router adds)")
    add_cluster_arguments(serving)
    # No default: with --url, --model is an override of what the router reports (the local
    # cluster still starts `tiny` when it is not given).
    serving.set_defaults(func=run, model=None)


def run(args: argparse.Namespace) -> int:
    import asyncio

    if args.request_rate <= 0:
        raise UserError(f"--request-rate {args.request_rate} must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError("--max-concurrency must be >= 1")
    if args.url is not None:
        if args.direct:
            raise UserError("--direct needs the local cluster; it cannot be combined with --url")
        return asyncio.run(_bench(args, args.url, None))

    from deepseek_pd.launcher.cluster import LocalCluster

    args.model = args.model or "tiny"
    with LocalCluster(cluster_spec_from_args(args)) as cluster:
        print(f"local cluster ready at {cluster.router_url}")
        return asyncio.run(_bench(args, cluster.router_url, cluster.served_model_name, cluster))


def _pd_pairs(cluster):
    """Every prefill with every decode worker of the local cluster, as direct gRPC clients."""
    from deepseek_pd.client.pd_dispatch import PDClient

    host = cluster.spec.host
    return [PDClient(p.address(host), host, p.bootstrap_port, d.address(host))
            for p in cluster.prefill_workers() for d in cluster.decode_workers()]


async def _bench(args: argparse.Namespace, url: str, served_name: str | None, cluster=None) -> int:
    from deepseek_pd.client.router_http import RouterClient
    from deepseek_pd.loadgen.metrics import SLO, summarize
    from deepseek_pd.loadgen.report import write_json, write_png
    from deepseek_pd.loadgen.runner import pd_direct_target, router_target, run_load
    from deepseek_pd.loadgen.speculation import scrape_totals, speculation_summary
    from deepseek_pd.loadgen.target_model import discover_target_model
    from deepseek_pd.loadgen.workload import WorkloadSpec, build_requests

    override = args.model if cluster is None else None  # the local cluster serves args.model anyway
    from deepseek_pd.gateway import read_key_file

    api_key = read_key_file(args.api_key_file, "--api-key-file")
    admin_key = (cluster.control_plane_key if cluster is not None
                 else read_key_file(args.admin_key_file, "--admin-key-file"))
    target = await discover_target_model(url, args.model_name or served_name, override,
                                         api_key=api_key, admin_key=admin_key, tokenizer=args.tokenizer,
                                         seed=args.seed)
    vocabulary = (target.vocab_size if target.vocab_size is not None
                  else f"the {len(target.token_ids)} ids the gateway's tokenizer gave")
    print(f"model {target.name!r}: vocabulary {vocabulary}, context {target.max_context_length} "
          f"(from {target.source}); KV bytes per token {target.kv_bytes_per_token} "
          f"(from {target.kv_bytes_source})")
    for worker in target.workers:
        print(f"worker {worker['kind'] or '?'} {worker['url']}: KV capacity {worker['kv_capacity_tokens']} tokens")
    if target.left_out:
        print(f"left out: {target.left_out}")
    spec = WorkloadSpec(args.num_prompts, args.dataset, args.input_len, args.output_len, args.range_ratio,
                        args.seed, output_range_ratio=args.output_range_ratio
                        ).validate(target.vocabulary, target.max_context_length)
    requests = build_requests(spec, target.vocabulary)
    metrics_urls = list(args.worker_metrics_url)
    if cluster is not None:  # every rank of every decode worker exports its own
        metrics_urls += [w.metrics_url(cluster.spec.host, r) for w in cluster.decode_workers() for r in range(w.ranks)]
    spec_before = scrape_totals(metrics_urls)
    if args.direct:
        pairs = _pd_pairs(cluster)
        try:
            records, duration = await run_load(pd_direct_target(pairs), requests, args.request_rate,
                                               args.max_concurrency, args.seed, not args.no_progress)
        finally:
            for pair in pairs:
                await pair.close()
    else:
        async with RouterClient(url, target.name, timeout_s=args.request_timeout,
                                api_key=api_key) as client:
            records, duration = await run_load(router_target(client), requests, args.request_rate,
                                               args.max_concurrency, args.seed, not args.no_progress)
    summary = summarize(records, duration, SLO(args.slo_ttft_ms, args.slo_tpot_ms))
    summary["kv_bytes_per_token"] = target.kv_bytes_per_token
    summary["left_out"] = target.left_out
    summary["workers"] = list(target.workers)
    summary["speculative"] = speculation_summary(spec_before, scrape_totals(metrics_urls))
    config = {"url": None if args.direct else url, "direct": args.direct, "model": target.name,
              "model_dir": target.model_path, "target_model": target.report_fields(),
              "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
              "workload": vars(spec), "kv_transport": args.kv_transport if args.url is None else None,
              "num_prefill": args.prefill if args.url is None else None,
              "num_decode": args.decode if args.url is None else None}
    write_json(args.output_json, config, summary, records)
    write_png(args.output_png, summary, records,
              f"{target.name}{' (direct, no router)' if args.direct else ''}: "
              f"{spec.dataset} {spec.input_len}/{spec.output_len}, "
              f"rate {args.request_rate}, concurrency {args.max_concurrency}")
    _print_summary(summary, args.output_json, args.output_png)
    return 0 if summary["failed"] == 0 else 1


def _print_summary(summary: dict, json_path: Path, png_path: Path) -> None:
    print(f"completed {summary['completed']}/{summary['num_requests']} in {summary['duration_s']:.2f}s"
          f" ({summary['failed']} failed)")
    print(f"throughput: {summary['request_throughput']:.2f} req/s, "
          f"{summary['input_throughput']:.1f} input tok/s, {summary['output_throughput']:.1f} output tok/s;"
          f" goodput {summary['goodput']:.2f} req/s")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = summary[name]
        if stats["p50"] is not None:
            print(f"{name:>15}: mean {stats['mean']:.1f}  p50 {stats['p50']:.1f}  p90 {stats['p90']:.1f}"
                  f"  p99 {stats['p99']:.1f}")
    if summary.get("left_out"):
        print("KV bytes per token: left out (only the workers know it; pass --admin-key-file)")
    else:
        print(f"KV bytes per token: {summary['kv_bytes_per_token']}")
    if summary.get("speculative"):
        from deepseek_pd.loadgen.speculation import describe

        print(describe(summary["speculative"]))
    for error in summary["errors"]:
        print(f"error: {error}")
    print(f"wrote {json_path} and {png_path}")
