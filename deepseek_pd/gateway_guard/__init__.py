"""A bound on `n` (samples per request) that the gateway enforces before it fans a request out.

Why: smg 1.13 bounds `n` on the OpenAI routes (chat 10, completions 128) but not on `/generate`,
and it expands a request into its `n` single-sample requests in its own memory before any worker
sees one: `/generate` with `n = 1000000` took the gateway from 60 MiB to 2.6 GB in 2 s and on to
9.4 GB, while `/liveness` stayed 200. smg has no setting for it, and a worker cannot refuse what
it is never sent. smg does run WASM middleware (`--enable-wasm`, modules added through its
control plane, `POST /wasm`) on the serving routes' bodies before routing; `n_guard.wat` is ours:
a body with a key "n" above MAX_SAMPLES (at any depth, so `sampling_params.n` and a top-level `n`
alike) is answered `400` with an empty body, before smg parses it. So is a body with a key "seed"
whose value is a number: smg 1.13 drops the seed on its way to the workers (docs/operations.md),
and a refusal is better than a request served unseeded. (smg's reject carries a status only, so
the 400 has no body that names the field.)

    argv += ENABLE_ARGS                               # on the router's command line
    install(router_url, control_plane_key)            # once it answers, after every (re)start

`up` installs it at start and its supervisor after every router restart; in Kubernetes the
router container's postStart hook runs `post_start_command` (`python -m deepseek_pd.gateway_guard`).

smg's WASM middleware reads each serving request's whole body (at most 10 MiB, its
`max_body_size`; larger bodies get 400) into a fresh instance of the component; the scan is one
pass over the bytes. If the module cannot run (a trap), smg lets the request through.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from deepseek_pd.errors import UserError

# smg's own bound on /v1/completions; chat's is 10. Each sample is a whole PD request on the workers.
MAX_SAMPLES = 128

COMPONENT = Path(__file__).with_name("n_guard.wasm")  # built by build.py from n_guard.wat
MODULE_NAME = "deepseek-pd-n-guard"
ENABLE_ARGS = ("--enable-wasm",)


def post_start_command(port: int, key_env: str) -> list[str]:
    """A router container's postStart hook: load the guard once the gateway on `port` answers
    (__main__.py), with the control-plane key from the environment variable `key_env`."""
    return ["python3", "-m", "deepseek_pd.gateway_guard", "--port", str(port), "--key-env", key_env]


def install_request(component: Path = COMPONENT) -> dict:
    """smg's `POST /wasm` body: the component, attached before routing (OnRequest)."""
    return {"modules": [{"name": MODULE_NAME, "file_path": str(component.resolve()), "module_type": "Middleware",
                         "attach_points": [{"Middleware": "OnRequest"}]}]}


def install(router_url: str, control_plane_key: str, timeout_s: float = 10.0) -> None:
    """Loads the guard into a running gateway; raises `UserError` with smg's answer if it refuses."""
    body = json.dumps(install_request()).encode()
    request = urllib.request.Request(f"{router_url}/wasm", body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {control_plane_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            answer = json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as error:
        raise UserError(f"the gateway refused the n guard ({error.code}): {error.read()[:500]!r}") from error
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise UserError(f"could not load the n guard into the gateway at {router_url}: {error}") from error
    results = [m.get("add_result") for m in answer.get("modules", [])]
    if not results or any(not isinstance(r, dict) or "Success" not in r for r in results):
        raise UserError(f"the gateway did not load the n guard: {answer}")
