"""`python -m deepseek_pd.gateway_guard --port P --key-env VAR`: loads the guard into the gateway on
this host once it answers; the router container's postStart hook in Kubernetes
(operator/build_router.py), where nothing else runs after the gateway starts. Exits 1 with the
reason when the gateway does not answer within `--wait-s` or refuses the module (the kubelet then
restarts the container, so a router never serves long without it).
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

from deepseek_pd import env
from deepseek_pd.errors import UserError
from deepseek_pd.gateway_guard import install


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/liveness", timeout=2.0) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepseek_pd.gateway_guard", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="the gateway's HTTP port on 127.0.0.1")
    parser.add_argument("--key-env", required=True, help="environment variable holding the control-plane key")
    parser.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for the gateway to answer")
    args = parser.parse_args(argv)
    key = env.named_variable(args.key_env)
    if not key:
        print(f"gateway_guard: ${args.key_env} is empty: no control-plane key", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.wait_s
    while not answers(url):
        if time.monotonic() > deadline:
            print(f"gateway_guard: {url}/liveness did not answer within {args.wait_s:.0f}s", file=sys.stderr)
            return 1
        time.sleep(0.5)
    try:
        install(url, key)
    except UserError as error:
        print(f"gateway_guard: {error}", file=sys.stderr)
        return 1
    print(f"gateway_guard: loaded into {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
