"""`deepseek-pd serve prefill|decode`: one SglangScheduler worker, as a pod runs it (ARCHITECTURE §4)."""
from __future__ import annotations

import argparse

from deepseek_pd.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run one prefill or decode worker (gRPC SglangScheduler)",
        description="Run one prefill or decode worker. The router reaches it at --host:--port; "
                    "decode workers reach a prefill worker's bootstrap service at --bootstrap-port.")
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--model", default="tiny", help="HF checkpoint directory, or 'tiny' (default)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients put in 'model' (default: 'tiny' or the directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--advertise-host", default=None,
                        help="address peers reach this worker at (KV transfer); default: --host, or "
                             "this machine's address when --host is 0.0.0.0 (the pod IP in Kubernetes)")
    parser.add_argument("--port", type=int, default=30001, help="gRPC port (default 30001)")
    parser.add_argument("--bootstrap-port", type=int, default=8998,
                        help="prefill: port of the bootstrap (handshake/KV) service (default 8998)")
    parser.add_argument("--kv-transport", choices=["mooncake", "grpc"], default="grpc",
                        help="how KV moves from prefill to decode (default grpc)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto|float32|bfloat16")
    parser.add_argument("--page-size", type=int, default=None,
                        help="KV page size in tokens (default: the model runner's, 16)")
    parser.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="prefill token budget per batch")
    parallel = parser.add_argument_group("parallelism (one worker over several GPUs/nodes)")
    parallel.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parallel.add_argument("--dp", type=int, default=1, help="data parallel (attention) size")
    parallel.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parallel.add_argument("--deepep-mode", default="none", choices=["none", "normal", "low_latency", "auto"])
    parallel.add_argument("--nnodes", type=int, default=1, help="nodes (pods) in this worker's group")
    parallel.add_argument("--node-rank", type=int, default=0, help="this pod's rank in the group")
    parallel.add_argument("--dist-init-addr", default="", help="HOST:PORT of rank 0, for torch.distributed")
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="engine-specific setting, repeatable")
    parser.add_argument("--engine-factory", default=None, metavar="MODULE:FUNC",
                        help="build the engine with this function instead of the default one")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let running requests finish after SIGTERM (default 30)")
    parser.set_defaults(func=run)


def parse_engine_opts(items: list[str]) -> dict[str, str]:
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--engine-opt {item!r} must be KEY=VALUE")
        opts[key] = value
    return opts


def advertised_address(bind_host: str) -> str:
    """A wildcard bind address cannot be handed to peers; use this host's own address instead."""
    import socket

    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise UserError(f"--host {bind_host!r} needs --advertise-host: cannot resolve this "
                        f"machine's address ({exc})") from exc


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deepseek_pd.launcher.cluster import default_served_name, resolve_model_dir
    from deepseek_pd.workers.common.engine_factory import ParallelOptions, WorkerOptions
    from deepseek_pd.workers.common.worker_main import configure_logging, serve_worker

    for name in ("port", "bootstrap_port"):
        value = getattr(args, name)
        if not 0 < value < 65536:
            raise UserError(f"--{name.replace('_', '-')} {value} is not a TCP port")
    configure_logging(args.role)
    page_size = args.page_size
    if page_size is None:  # GetLoads reports tokens, so the servicer must know the real size
        from deepseek_pd.model.runner import RunnerConfig

        page_size = RunnerConfig().page_size
    model_dir = resolve_model_dir(args.model)
    served = args.served_model_name or default_served_name(args.model, model_dir)
    options = WorkerOptions(
        role=args.role, model_dir=str(model_dir), served_model_name=served, host=args.host,
        advertise_host=args.advertise_host or advertised_address(args.host),
        port=args.port, bootstrap_port=args.bootstrap_port, kv_transport=args.kv_transport,
        device=args.device, dtype=args.dtype, page_size=page_size, num_pages=args.num_pages,
        chunked_prefill_size=args.chunked_prefill_size, engine_options=parse_engine_opts(args.engine_opt),
        parallel=ParallelOptions(args.tp, args.dp, args.ep, args.deepep_mode, args.nnodes,
                                 args.node_rank, args.dist_init_addr))
    asyncio.run(serve_worker(options, args.engine_factory, args.drain_timeout))
    return 0
