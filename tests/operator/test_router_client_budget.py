"""`router.clientBudget` rendered by the operator: the policy ConfigMap, its mount and the flags
smg's own parser reads, the same policy text `up` writes, a changed budget rolling the router and
a removed one cleaning up; and the real API server's schema refusing bad budgets."""
from __future__ import annotations

import asyncio
import logging
import random

import yaml
from leader_urls import router_flags
from memory_api import MemoryApi
from test_operator_reconcile import EXAMPLES

from deepseek_pd import gateway
from deepseek_pd.operator import names
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.operator.router_client_budget import ANNOTATION, MOUNT, config_map_name

LOG = logging.getLogger("test")


def _body(budget: dict | None) -> dict:
    body = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    body["metadata"].update(namespace="llm", uid="u-1", generation=1)
    if budget is not None:
        body["spec"].setdefault("router", {})["clientBudget"] = budget
    return body


def _router(api: MemoryApi) -> dict:
    return api.objects[("Deployment", names.router_name("tiny"))]


def test_the_budget_is_mounted_and_loaded_as_up_writes_it():
    rng = random.Random()
    api = MemoryApi()
    reconciler = Reconciler(api)
    rpm = rng.randint(1, 10_000)
    header = rng.choice([None, "X-Real-IP", "X-Client-Id"])
    budget = {"requestsPerMinute": rpm, **({"clientHeader": header} if header else {})}
    asyncio.run(reconciler.reconcile(_body(budget), LOG))

    config_map = api.objects[("ConfigMap", config_map_name("tiny"))]
    assert config_map["data"] == {gateway.CLIENT_BUDGET_FILE: gateway.client_budget_policy(rpm)}
    assert yaml.safe_load(config_map["data"][gateway.CLIENT_BUDGET_FILE])["default_policy"]["requests_per_minute"] == rpm
    router = _router(api)
    parsed = router_flags(router)  # smg's own launcher reads the flags
    assert parsed.tenant_rate_limit_enabled and parsed.tenant_rate_limit_config == f"{MOUNT}/{gateway.CLIENT_BUDGET_FILE}"
    assert parsed.trust_tenant_header is bool(header) and (not header or parsed.tenant_header_name == header)
    pod = router["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == config_map_name("tiny"))
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == MOUNT and mount["readOnly"]

    # A new budget rolls the router (smg reads the file at start only); no budget removes it all.
    before = router["spec"]["template"]["metadata"]["annotations"][ANNOTATION]
    asyncio.run(reconciler.reconcile(_body({**budget, "requestsPerMinute": rpm + 1}), LOG))
    assert _router(api)["spec"]["template"]["metadata"]["annotations"][ANNOTATION] != before
    asyncio.run(reconciler.reconcile(_body(None), LOG))
    assert ("ConfigMap", config_map_name("tiny")) not in api.objects
    assert not router_flags(_router(api)).tenant_rate_limit_enabled
    assert ANNOTATION not in _router(api)["spec"]["template"]["metadata"].get("annotations", {})
