"""`deepseek-pd serve prefill|decode`: one SglangScheduler worker, as a pod runs it (ARCHITECTURE §4)."""
from __future__ import annotations

import argparse


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
    parser.add_argument("--bootstrap-alias", action="append", default=[], metavar="NAME",
                        help="prefill: another name decode workers may dial this bootstrap service at "
                             "(e.g. the pod's DNS name, which the router hands decode); repeatable")
    parser.add_argument("--port", type=int, default=30001, help="gRPC port (default 30001)")
    parser.add_argument("--bootstrap-port", type=int, default=8998,
                        help="prefill: port of the bootstrap (handshake/KV) service (default 8998)")
    parser.add_argument("--kv-transport", choices=["mooncake", "grpc"], default="grpc",
                        help="how KV moves from prefill to decode (default grpc)")
    parser.add_argument("--kv-protocol", choices=["tcp", "rdma"], default="tcp",
                        help="mooncake: the transfer engine's protocol (default tcp)")
    parser.add_argument("--kv-devices", default="", metavar="HCA[,HCA...]",
                        help="mooncake rdma: the RDMA devices to use, e.g. mlx5_0,mlx5_1 (default: all usable)")
    parser.add_argument("--kv-tcp-fallback", action="store_true",
                        help="mooncake rdma: use tcp (with a warning) when no RDMA device is usable, "
                             "instead of refusing to start")
    parser.add_argument("--device", default="auto",
                        help="torch device: auto (CUDA when available, else cpu; default), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model dtype; auto: the checkpoint's torch_dtype on CUDA (bfloat16 for FP8 "
                             "checkpoints), float32 on cpu")
    parser.add_argument("--page-size", type=int, default=None,
                        help="KV page size in tokens (default: the model runner's, 16)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None,
                      help="KV pool size in pages (overrides --mem-fraction-static)")
    pool.add_argument("--max-total-tokens", type=int, default=None,
                      help="KV pool size in tokens, rounded up to whole pages (overrides --mem-fraction-static)")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="CUDA: the fraction of the GPU's total memory for weights + KV pool + activation "
                             "headroom; the pool gets what is left after the weights load (default 0.88; "
                             "cpu: a fixed pool of 1024 pages)")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="prompt tokens per prefill round (default: 2048 on the CPU; on a GPU by its "
                             "memory, as SGLang: 2048 below 35 GiB, 8192 below 160 GiB, else 16384)")
    parallel = parser.add_argument_group("parallelism (one worker over several GPUs/nodes)")
    parallel.add_argument("--tp", type=int, default=1,
                          help="attention tensor parallel size: ranks of one DP group that split the MLA heads "
                               "and run the same batch (world = tp x dp)")
    parallel.add_argument("--dp", type=int, default=1,
                          help="data parallel (attention) groups: each attends its own requests and holds their KV")
    parallel.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parallel.add_argument("--deepep-mode", default="none", choices=["none", "normal", "low_latency", "auto"])
    parallel.add_argument("--nnodes", type=int, default=1, help="nodes (pods) in this worker's group")
    parallel.add_argument("--node-rank", type=int, default=0, help="this pod's rank in the group")
    parallel.add_argument("--dist-init-addr", default="", help="HOST:PORT of rank 0, for torch.distributed")
    parallel.add_argument("--enable-tbo", action="store_true",
                          help="two-batch overlap: each batch as two micro-batches whose EP all-to-alls overlap "
                               "the other's compute (the same as --engine-opt enable_tbo=true). SGLang's split: "
                               "decode in half, extend where the tokens balance, one dominating prompt cut in two "
                               "chunks (--engine-opt tbo_token_distribution_threshold=0.48, 0: never); the group "
                               "splits when its busiest rank has --engine-opt tbo_min_decode_tokens / "
                               "tbo_min_extend_tokens (default 2) tokens, idle ranks take part")
    parallel.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="R",
                          help="EPLB: R extra physical expert slots per MoE layer over the EP group, holding "
                               "replicas of hot experts ((n_routed_experts + R) must divide by --ep; default 0)")
    parallel.add_argument("--init-expert-location", default=None, metavar="FILE",
                          help="EPLB: placement JSON (physical_to_logical_map per MoE layer, e.g. from "
                               "`deepseek-pd eplb plan`); default: slot p holds expert p mod n_routed_experts")
    security = parser.add_argument_group("internal authentication (docs/operations.md, Security)")
    security.add_argument("--internal-secret-file", default=None,
                          help="file with the deployment secret that signs bootstrap/KV messages (default: "
                               "$DEEPSEEK_PD_INTERNAL_SECRET_FILE); `up` and the operator provide one")
    security.add_argument("--insecure-internal", action="store_true",
                          help="DEBUGGING ONLY: no authentication of bootstrap/KV messages")
    security.add_argument("--prefill-peers", default="",
                          help="decode: comma-separated HOST:PORT bootstrap addresses of this deployment's "
                               "prefill workers; KV is pulled from no other (default: loopback hosts only)")
    parser.add_argument("--speculative-num-steps", type=int, default=0, metavar="N",
                        help="decode: tokens the checkpoint's MTP layer drafts per step, verified in one forward "
                             "(0..8, default 0: off; the same as --engine-opt speculative_num_steps=N); a PD "
                             "prefill worker takes the same value, so both KV layouts hold the MTP layer")
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="any field of the worker's configs, repeatable (e.g. cuda_graph=false, "
                             "max_running_requests=32, mem_headroom_gib=4); unknown keys list the valid ones")
    parser.add_argument("--engine-factory", default=None, metavar="MODULE:FUNC",
                        help="TEST HOOK: build the engine with this function (it gets the resolved "
                             "ServeConfig and the WorkerMetrics) instead of the role's default builder")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://--metrics-host:PORT/metrics (default: off); "
                             "a multi-rank group serves rank r of a node on PORT + r")
    parser.add_argument("--metrics-host", default=None,
                        help="address of the metrics exporter (default: --host)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let running requests finish after SIGTERM (default 30)")
    parser.set_defaults(func=run)


def flags_from_args(args: argparse.Namespace):
    """The parsed command line as `ServeFlags` (nothing resolved yet)."""
    from deepseek_pd.workers.serve_resolution import ParallelFlags, ServeFlags

    return ServeFlags(
        role=args.role, model=args.model, served_model_name=args.served_model_name, host=args.host,
        advertise_host=args.advertise_host, bootstrap_aliases=tuple(args.bootstrap_alias), port=args.port, bootstrap_port=args.bootstrap_port,
        kv_transport=args.kv_transport, kv_protocol=args.kv_protocol, kv_devices=args.kv_devices,
        kv_tcp_fallback=args.kv_tcp_fallback, device=args.device, dtype=args.dtype, page_size=args.page_size,
        num_pages=args.num_pages, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static, chunked_prefill_size=args.chunked_prefill_size,
        parallel=ParallelFlags(args.tp, args.dp, args.ep, args.deepep_mode, args.nnodes, args.node_rank,
                               args.dist_init_addr, args.ep_num_redundant_experts, args.init_expert_location),
        engine_options=tuple(args.engine_opt) + (("enable_tbo=true",) if args.enable_tbo else ())
        + ((f"speculative_num_steps={args.speculative_num_steps}",) if args.speculative_num_steps else ()),
        drain_timeout_s=args.drain_timeout, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        internal_secret_file=args.internal_secret_file, insecure_internal=args.insecure_internal,
        prefill_peers=tuple(p for p in args.prefill_peers.split(",") if p.strip()))


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deepseek_pd.workers.common.worker_main import configure_logging, serve_worker
    from deepseek_pd.workers.serve_resolution import resolve_serve_config

    configure_logging(args.role)
    config = resolve_serve_config(flags_from_args(args))  # every default decided once, then frozen
    if not config.group.is_single_process:
        if args.engine_factory is not None:
            from deepseek_pd.errors import UserError

            raise UserError("--engine-factory builds one process's engine; it cannot be combined with a "
                            "multi-rank group (--tp/--dp > 1)")
        from deepseek_pd.workers.group_main import run_node

        return run_node(config)  # one process per rank of this node, in lockstep
    if args.engine_factory is not None:
        from deepseek_pd.workers.common.engine_factory import load_builder

        builder = load_builder(args.engine_factory)
    else:
        from deepseek_pd.workers.builders import BUILDERS

        builder = BUILDERS[config.role]
    asyncio.run(serve_worker(config, builder))
    return 0
