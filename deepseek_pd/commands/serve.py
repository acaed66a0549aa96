"""`deepseek-pd serve prefill|decode`: one SglangScheduler worker, as a pod runs it (ARCHITECTURE §4).

Its flags are the serve contract's (workers/serve/flags.py), which `up` and the operator render."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from deepseek_pd.workers.serve.flags import add_cli_args

    parser = subparsers.add_parser(
        "serve", help="run one prefill or decode worker (gRPC SglangScheduler)",
        description="Run one prefill or decode worker. The router reaches it at --host:--port; "
                    "decode workers reach a prefill worker's bootstrap service at --bootstrap-port.")
    add_cli_args(parser)
    parser.set_defaults(func=run)


def flags_from_args(args: argparse.Namespace):
    """The parsed command line as `ServeFlags` (nothing resolved yet)."""
    from deepseek_pd.workers.serve.flags import ServeFlags

    return ServeFlags.from_cli_args(args)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deepseek_pd.cpu_budget import apply_to_torch
    from deepseek_pd.workers.serve.worker_main import configure_logging, serve_worker
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    configure_logging(args.role)
    flags = flags_from_args(args)
    apply_to_torch()  # a container sees the node's CPUs but runs on its quota (cpu_budget.py)
    config = resolve_serve_config(flags)  # every default decided once, then frozen
    if not config.group.is_single_process:
        if flags.engine_factory is not None:
            from deepseek_pd.errors import UserError

            raise UserError("--engine-factory builds one process's engine; it cannot be combined with a "
                            "multi-rank group (--tp/--dp > 1)")
        from deepseek_pd.workers.serve.group_main import run_node

        return run_node(config)  # one process per rank of this node, in lockstep
    if flags.engine_factory is not None:
        from deepseek_pd.workers.serve.engine_factory import load_builder

        builder = load_builder(flags.engine_factory)
    else:
        from deepseek_pd.workers.serve.builders import BUILDERS

        builder = BUILDERS[config.role]
    asyncio.run(serve_worker(config, builder))
    return 0
