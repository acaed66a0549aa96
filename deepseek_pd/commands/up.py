"""`deepseek-pd up`: N prefill + M decode workers and the real router on this machine (ARCHITECTURE §4)."""
from __future__ import annotations

import argparse
from pathlib import Path

from deepseek_pd.errors import UserError
from deepseek_pd.launcher.worker_plan import TBO_CHOICES, resolve_group_shape


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="HF checkpoint directory, or 'tiny' (default)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers (default 1)")
    groups = parser.add_argument_group(
        "multi-rank workers (each worker a group of processes on this machine, gloo on CPU, one GPU per rank "
        "on CUDA; a failed rank restarts its whole group)")
    groups.add_argument("--prefill-ranks", type=int, default=1,
                        help="ranks (processes) of each prefill worker (default 1)")
    groups.add_argument("--decode-ranks", type=int, default=1,
                        help="ranks (processes) of each decode worker (default 1)")
    groups.add_argument("--dp", type=int, default=None,
                        help="attention data-parallel size of each multi-rank worker; must divide its ranks "
                             "(the rest is --tp: attention tensor parallelism within each DP group; default: all its ranks)")
    groups.add_argument("--ep", type=int, default=None,
                        help="expert parallel size of each multi-rank worker: its ranks (experts spread, the "
                             "default) or 1 (replicated)")
    groups.add_argument("--enable-tbo", nargs="?", const="both", default=None, choices=TBO_CHOICES,
                        help="two-batch overlap in the workers of both roles, or of one "
                             "(--enable-tbo=decode)")
    parser.add_argument("--speculative-num-steps", type=int, default=0, metavar="N",
                        help="speculative decoding with the checkpoint's MTP layer: N draft tokens per decode "
                             "step, given to every worker of both roles (a PD pair must agree; default 0: off)")
    parser.add_argument("--kv-transport", choices=["mooncake", "grpc"], default="grpc",
                        help="how KV moves from prefill to decode (default grpc)")
    parser.add_argument("--device", default="auto",
                        help="every worker's torch device: auto (CUDA when available, else cpu; default), "
                             "cpu, cuda, cuda:N")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="CUDA: the fraction of the GPU's total memory all workers together may use "
                             "(default 0.88): each worker's own copy of the weights and its headroom first, "
                             "the rest for the KV pools, split by role 2 prefill : 3 decode; "
                             "--worker-arg=--num-pages=N fixes the pools instead")
    parser.add_argument("--host", default="127.0.0.1", help="address everything listens on")
    parser.add_argument("--port", type=int, default=0, help="router HTTP port (default: a free one)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where worker and router logs go (default: a temporary directory)")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                        help="extra flag passed to every `deepseek-pd serve` (repeatable; "
                             "e.g. --worker-arg=--page-size=16; a page size goes to both roles, which must agree)")
    parser.add_argument("--policy", default=None,
                        help="the gateway's load-balancing policy for both roles: random, round_robin, "
                             "cache_aware or power_of_two (default: deepseek_pd/gateway.py's DEFAULT_POLICY, "
                             "chosen by bench/gateway_burst.py)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="file holding the key clients must send (Authorization: Bearer KEY) to the "
                             "router's API; default: open, which is what 127.0.0.1 is for")
    parser.add_argument("--client-requests-per-minute", type=int, default=0, metavar="N",
                        help="each client address may send N requests a minute to the router; past it, "
                             "429 with Retry-After (smg's tenant rate limit; default 0: no budget)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds to wait for everything to become healthy (default 300)")


def cluster_spec_from_args(args: argparse.Namespace):
    from deepseek_pd.gateway import DEFAULT_POLICY, read_key_file
    from deepseek_pd.launcher.cluster import ClusterSpec

    return ClusterSpec(model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                       prefill_group=group_shape_from_args(args, "prefill"),
                       decode_group=group_shape_from_args(args, "decode"),
                       kv_transport=args.kv_transport, device=args.device,
                       mem_fraction_static=args.mem_fraction_static, host=args.host, router_port=args.port,
                       log_dir=args.log_dir, worker_args=tuple(args.worker_arg),
                       speculative_num_steps=getattr(args, "speculative_num_steps", 0),
                       startup_timeout_s=args.startup_timeout,
                       policy=getattr(args, "policy", None) or DEFAULT_POLICY,
                       client_requests_per_minute=getattr(args, "client_requests_per_minute", 0),
                       client_api_key=read_key_file(getattr(args, "api_key_file", None), "--api-key-file")).validate()


def group_shape_from_args(args: argparse.Namespace, role: str):
    """`role`'s GroupShape from the flags; --dp/--ep without any multi-rank role is an error, not a no-op."""
    if max(args.prefill_ranks, args.decode_ranks) == 1:
        for name in ("dp", "ep"):
            if getattr(args, name) not in (None, 1):
                raise UserError(f"--{name} {getattr(args, name)} shapes multi-rank workers: add "
                                f"--prefill-ranks N and/or --decode-ranks M (N, M > 1)")
    return resolve_group_shape(role, getattr(args, f"{role}_ranks"), args.dp, args.ep,
                               enable_tbo=args.enable_tbo in (role, "both"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up", help="start prefill/decode workers and the router locally",
        description="Start N prefill and M decode workers plus the SGLang router in gRPC PD mode; "
                    "print the router URL once healthy; stop everything on Ctrl-C / SIGTERM. A worker may be "
                    "a group of ranks (--prefill-ranks/--decode-ranks): one process per rank, restarted "
                    "together when one fails.")
    add_cluster_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal
    import sys
    import threading

    from deepseek_pd.launcher.cluster import LocalCluster

    spec = cluster_spec_from_args(args)
    stop = threading.Event()

    def on_signal(signum, frame):  # SIGINT and SIGTERM both mean "shut everything down"
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = LocalCluster(spec)
    try:
        print(f"starting {spec.num_prefill} prefill ({spec.prefill_group.describe()}) + {spec.num_decode} decode "
              f"({spec.decode_group.describe()}) worker(s), model {spec.model}, KV transport {spec.kv_transport}; "
              f"logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        cluster.start()
        print(f"  workers on {cluster.device}", file=sys.stderr)
        for worker in cluster.workers:
            boot = f", bootstrap port {worker.bootstrap_port}" if worker.role == "prefill" else ""
            ranks = f" (rank r: port {worker.metrics_port} + r)" if worker.ranks > 1 else ""
            print(f"  {worker.process.name}: grpc://{worker.address(spec.host)}{boot}, "
                  f"metrics {worker.metrics_url(spec.host)}{ranks}, log {worker.process.log_path}", file=sys.stderr)
        print(f"router ready at {cluster.router_url} (model name {cluster.served_model_name!r})",
              flush=True)
        print(f"  router metrics: http://{spec.host}:{cluster.metrics_port}/metrics", file=sys.stderr)
        print(f"  control-plane key (add/remove workers): {cluster.log_dir / 'control-plane-key'}",
              file=sys.stderr, flush=True)
        # A crashed worker or a crashed/hung router is restarted; one that keeps crashing stops up.
        supervisor = cluster.supervisor()
        while not stop.wait(1.0):
            try:
                supervisor.step()
            except UserError as exc:
                print(f"{exc}; stopping.", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        # Signals during cleanup must not cut it short and leave orphans behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping...", file=sys.stderr, flush=True)
        cluster.stop()
        print("stopped", file=sys.stderr, flush=True)
    return 0
