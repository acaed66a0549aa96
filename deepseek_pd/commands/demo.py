"""`deepseek-pd demo`: the README's first run. Starts a 1P1D cluster on the embedded tiny model with
the real router, streams one chat answer through `/v1/chat/completions`, and shuts down.

The tiny model has random weights, so the answer is fluent-looking nonsense; what the demo shows is
the path: router -> prefill -> KV transfer -> decode -> streamed tokens.
"""
from __future__ import annotations

import argparse

DEFAULT_PROMPT = "What is prefill/decode disaggregation?"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="start a local PD cluster, stream one chat answer, stop")
    parser.add_argument("--model", default="tiny", help="HF checkpoint directory, or 'tiny' (default)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--kv-transport", choices=["mooncake", "grpc"], default="grpc")
    parser.add_argument("--log-dir", default=None, help="keep worker/router logs here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys
    from pathlib import Path

    from deepseek_pd.client.router_http import RouterClient
    from deepseek_pd.launcher.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(model=args.model, kv_transport=args.kv_transport,
                       log_dir=Path(args.log_dir) if args.log_dir else None)
    print(f"starting 1 prefill + 1 decode worker and the router (model {args.model}, "
          f"KV over {args.kv_transport})...", file=sys.stderr, flush=True)
    with LocalCluster(spec) as cluster:
        print(f"router ready at {cluster.router_url}; logs in {cluster.log_dir}", file=sys.stderr)
        print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)

        async def chat():
            async with RouterClient(cluster.router_url, cluster.served_model_name) as client:
                return await client.chat(
                    [{"role": "user", "content": args.prompt}], stream=True,
                    on_text=lambda piece: print(piece, end="", flush=True),
                    max_tokens=args.max_tokens, temperature=args.temperature)

        result = asyncio.run(chat())
        ttft = "n/a" if result.ttft is None else f"{result.ttft * 1e3:.0f} ms"
        print(f"\n\n[{result.completion_tokens} tokens, finish reason {result.finish_reason}, "
              f"first token after {ttft}]", file=sys.stderr)
    print("cluster stopped", file=sys.stderr)
    return 0
