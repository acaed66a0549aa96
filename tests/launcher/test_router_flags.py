"""The gateway command line `up` builds: policy and retries as smg itself parses them."""
from __future__ import annotations

import random

import pytest

from deepseek_pd import gateway
from deepseek_pd.errors import UserError
from deepseek_pd.launcher.cluster import ClusterSpec, LocalCluster


def parsed_router_args(spec: ClusterSpec, tmp_path):
    from smg.launch_router import parse_router_args

    cluster = LocalCluster(spec)
    cluster.model_dir = tmp_path
    argv = cluster._router_argv()
    assert argv[1:3] == ["-m", gateway.ROUTER_MODULE]
    return parse_router_args(argv[3:])


def test_policy_reaches_the_gateway_and_retries_outlast_health_checks(tmp_path) -> None:
    policy = random.choice(gateway.POLICIES)
    parsed = parsed_router_args(ClusterSpec(policy=policy, log_dir=tmp_path / "logs"), tmp_path)
    assert parsed.policy == policy
    assert not parsed.disable_retries and parsed.retry_max_retries > 1 and parsed.disable_circuit_breaker
    backoff_s = sum(min(parsed.retry_max_backoff_ms, parsed.retry_initial_backoff_ms * parsed.retry_backoff_multiplier ** i)
                    for i in range(parsed.retry_max_retries - 1)) / 1000
    # Every attempt after the first waits; together they must outlast the removal of a dead worker.
    assert backoff_s > parsed.health_check_interval_secs * parsed.health_failure_threshold
    assert parsed.max_payload_size == gateway.MAX_PAYLOAD_BYTES


def test_default_policy_and_bad_policy(tmp_path) -> None:
    assert ClusterSpec().policy == gateway.DEFAULT_POLICY in gateway.POLICIES
    with pytest.raises(UserError, match="--policy 'fastest'"):
        ClusterSpec(policy="fastest").validate()


def test_a_client_budget_reaches_the_gateway_as_a_tenant_policy(tmp_path) -> None:
    budget = random.randint(1, 10_000)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    parsed = parsed_router_args(ClusterSpec(client_requests_per_minute=budget, log_dir=log_dir), tmp_path)
    assert parsed.tenant_rate_limit_enabled and not parsed.trust_tenant_header
    policy = (log_dir / gateway.CLIENT_BUDGET_FILE).read_text()
    assert parsed.tenant_rate_limit_config == str(log_dir / gateway.CLIENT_BUDGET_FILE)
    assert f"requests_per_minute: {budget}\n" in policy and policy.startswith("default_policy:\n")
    assert not parsed_router_args(ClusterSpec(log_dir=log_dir), tmp_path).tenant_rate_limit_enabled
    with pytest.raises(UserError, match="--client-requests-per-minute -1"):
        ClusterSpec(client_requests_per_minute=-1).validate()
