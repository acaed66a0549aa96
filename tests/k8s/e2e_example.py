"""The example the operator end-to-end tests apply, and the router check they share.

    example(models)                         examples/cpu-minimal.yaml ready for the process kubelet
    apply(dep, obj)                         `kubectl apply -f` of one object into dep's namespace
    greedy_through_router(dep, engine, n)   n streamed requests through the router's Service equal
                                            the offline engine's greedy tokens
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import random
import subprocess
import time

import pytest
import yaml
from e2e_deployment import Deployment

ROOT = pathlib.Path(__file__).resolve().parents[2]


def example(models: pathlib.Path, file: str = "cpu-minimal.yaml") -> dict:
    """examples/`file` with its hostPath pointed at `models` and the e2e engine flags
    (small pages and chunks, as the offline engine uses them)."""
    from pdtest.e2e_cluster import WORKER_ARGS

    cr = yaml.safe_load((ROOT / "examples" / file).read_text())
    cr["spec"]["model"]["source"]["hostPath"]["path"] = str(models)
    for role in ("prefill", "decode"):
        cr["spec"][role]["engineArgs"] = list(WORKER_ARGS)
    return cr


def apply(dep: Deployment, obj: dict, check: bool = True) -> subprocess.CompletedProcess:
    path = dep.workdir / f"{obj['metadata']['name']}-{random.randrange(10**6)}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return dep.kubectl_run("apply", "-n", dep.namespace, "-f", path, check=check)


def greedy_through_router(dep: Deployment, engine, count: int = 3, max_new: int = 8,
                          recover_s: float = 0.0) -> list[tuple[list[int], list[int]]]:
    """Streamed /generate requests through the router's Service equal the offline engine.
    `recover_s`: for this long the first request may be refused (503/504) while the gateway's
    health checks re-admit a replaced worker; every answer it gives must still be right.
    Returns (prompt, tokens) of every request answered, the first (1 token) included."""
    from deepseek_pd.client.router_http import RouterClient, RouterError
    from deepseek_pd.model.sampling.params import SamplingParams

    rng = random.Random()
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(3, 70))] for _ in range(count)]
    expected = [list(engine.generate(p, SamplingParams(max_new_tokens=max_new, temperature=0.0)).output_ids)
                for p in prompts]
    url = dep.router_url()
    answered: list[tuple[list[int], list[int]]] = []

    async def main():
        async with RouterClient(url, "tiny", timeout_s=120) as client:
            deadline = time.monotonic() + recover_s
            while True:
                try:
                    first = await client.generate(input_ids=prompts[0], max_new_tokens=1, temperature=0.0)
                    answered.append((prompts[0], list(first.output_ids)))
                    break
                except RouterError as exc:
                    if exc.status not in (503, 504) or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
            for prompt, want in zip(prompts, expected):
                got = await client.generate(input_ids=prompt, stream=True, max_new_tokens=max_new, temperature=0.0)
                assert got.output_ids == want, (len(prompt), got.output_ids, want)
                answered.append((prompt, list(got.output_ids)))

    try:
        asyncio.run(main())
    except Exception as exc:  # noqa: BLE001 (the failure is reported with the pods' logs)
        if os.environ.get("K8SE2E_HOLD"):
            time.sleep(float(os.environ["K8SE2E_HOLD"]))
        pytest.fail(f"request through the router failed: {exc!r}\n{dep.diagnose()}")
    return answered
