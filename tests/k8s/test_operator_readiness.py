"""The operator's /readyz (operator/readiness.py) against the real API server: ready only once
kopf has started *and* the server accepts the operator's credentials and serves the CRD; a
revoked (here: unknown) token or a missing CRD keeps it unready with the server's own words.
The chart's readiness probe points at it (tests/charts/test_chart_hardening.py), and the e2e
`helm install --wait` waits for it (test_operator_e2e.py)."""
from __future__ import annotations

import asyncio
import random

import aiohttp
import kopf
import pytest
from kube_rest import Credentials
from test_rendered_objects import _install_crd

from deepseek_pd.ports import pick_free_ports
from deepseek_pd.operator.kube import KubeClient
from deepseek_pd.operator.readiness import PATH, Readiness, serve_readiness

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _client(creds: Credentials) -> KubeClient:
    return KubeClient(lambda: kopf.ConnectionInfo(server=creds.server, token=creds.token,
                                                  ca_path=str(creds.ca_path)))


async def _probe(port: int) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}{PATH}") as resp:
            return resp.status, await resp.text()


def test_readyz_answers_200_only_when_kopf_started_and_the_api_accepts_the_token(control_plane, admin_kube):
    _install_crd(admin_kube)
    admin = control_plane.admin
    stranger = Credentials(admin.server, random.randbytes(16).hex(), admin.ca_path)

    async def scenario() -> None:
        good, bad = _client(admin), _client(stranger)
        flag = asyncio.Event()
        ready, unknown = Readiness(flag, good.served, max_age=0), Readiness(flag, bad.served, max_age=0)
        port, bad_port = pick_free_ports(2)
        runners = [await serve_readiness(ready, "127.0.0.1", port),
                   await serve_readiness(unknown, "127.0.0.1", bad_port)]
        try:
            status, text = await _probe(port)
            assert (status, text.strip()) == (503, "kopf: not started yet")
            flag.set()  # what kopf does once its startup handlers have run
            assert await _probe(port) == (200, "ok\n")
            status, text = await _probe(bad_port)
            assert status == 503 and "401" in text, text
        finally:
            for runner in runners:
                await runner.cleanup()
            await good.close()
            await bad.close()

    asyncio.run(scenario())


def test_readiness_caches_its_answer_so_probes_cost_one_request_per_max_age(control_plane, admin_kube):
    _install_crd(admin_kube)
    calls = []
    client = _client(control_plane.admin)

    async def counted() -> dict:
        calls.append(1)
        return await client.served()

    async def scenario() -> None:
        flag = asyncio.Event()
        flag.set()
        readiness = Readiness(flag, counted, max_age=60)
        answers = await asyncio.gather(*(readiness.check() for _ in range(20)))
        assert answers == [(True, "ok")] * 20 and len(calls) == 1
        await client.close()

    asyncio.run(scenario())
