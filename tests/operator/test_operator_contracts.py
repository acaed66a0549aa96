"""The command lines the operator renders, parsed by the real programs that will receive them."""
from __future__ import annotations

import pathlib
import random

import pytest
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.operator import names
from deepseek_pd.operator.build_router import build_router_args
from deepseek_pd.operator.build_workers import build_worker_args
from deepseek_pd.operator.spec import DeploymentSpec

pytestmark = pytest.mark.timeout(60)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _spec(example: str) -> DeploymentSpec:
    return DeploymentSpec.parse("demo", "llm", yaml.safe_load((EXAMPLES / example).read_text())["spec"])


def _raw(example: str, discovery: str) -> dict:
    raw = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    raw.setdefault("router", {})["workerDiscovery"] = discovery
    return raw


def _common_flags(parsed, spec: DeploymentSpec) -> None:
    assert parsed.pd_disaggregation
    assert parsed.policy == spec.router.policy and parsed.port == spec.router.port
    assert parsed.host == "0.0.0.0" and parsed.model_path == spec.model.path
    # Bad client requests must not open the breaker on healthy workers (see ROUTER_RESILIENCE_ARGS);
    # retries are on (more than one attempt) and outlast the health checks' removal of a dead worker.
    assert parsed.disable_circuit_breaker and not parsed.disable_retries and parsed.retry_max_retries > 1
    backoff = sum(min(parsed.retry_max_backoff_ms, parsed.retry_initial_backoff_ms * parsed.retry_backoff_multiplier ** i)
                  for i in range(parsed.retry_max_retries - 1)) / 1000
    assert backoff > parsed.health_check_interval_secs * parsed.health_failure_threshold


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_selector_router_args_parse_with_sgl_model_gateway(example):
    from smg.launch_router import parse_router_args

    spec = DeploymentSpec.parse("demo", "llm", _raw(example, "Selector"))
    args = build_router_args(spec)
    assert args[:2] == ["-m", "smg.launch_router"]
    parsed = parse_router_args(args[2:])
    _common_flags(parsed, spec)
    assert parsed.service_discovery and parsed.service_discovery_namespace == "llm"
    assert parsed.service_discovery_port == spec.decode.port
    assert parsed.prefill_selector == names.router_pod_selector("demo", "prefill")
    assert parsed.decode_selector == names.router_pod_selector("demo", "decode")
    assert parsed.prefill_urls == [] and parsed.decode_urls == []


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_static_router_args_parse_with_sgl_model_gateway(example):
    """Several groups per role: every leader once, as gRPC, prefill with its bootstrap port."""
    from smg.launch_router import parse_router_args

    raw = _raw(example, "Static")
    raw["prefill"]["replicas"], raw["decode"]["replicas"] = random.randint(2, 5), random.randint(2, 5)
    raw["router"]["extraArgs"] = ["--worker-startup-timeout-secs", "7200"]
    spec = DeploymentSpec.parse("demo", "llm", raw)
    args = build_router_args(spec)
    assert args[:2] == ["-m", "smg.launch_router"]
    parsed = parse_router_args(args[2:])
    _common_flags(parsed, spec)
    assert not parsed.service_discovery
    assert len(parsed.prefill_urls) == raw["prefill"]["replicas"]
    assert len(set(parsed.prefill_urls)) == len(parsed.prefill_urls)
    assert {port for _, port in parsed.prefill_urls} == {spec.prefill.bootstrap_port}
    assert len(set(parsed.decode_urls)) == raw["decode"]["replicas"]
    urls = [url for url, _ in parsed.prefill_urls] + parsed.decode_urls
    assert all(url.startswith("grpc://") and url.endswith(".llm.svc:30000") for url in urls)
    assert parsed.worker_startup_timeout_secs == 7200  # router.extraArgs override what we render


def test_cpu_worker_args_parse_with_deepseek_pd_serve():
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    raw["prefill"]["bootstrapPort"] = random.randint(9000, 9999)
    raw["prefill"]["engineArgs"] = ["--chunked-prefill-size=256"]
    spec = DeploymentSpec.parse("demo", "llm", raw)
    parser = build_parser()
    for role in names.ROLES:
        args = parser.parse_args(build_worker_args(spec, spec.role(role)))
        assert args.command == "serve" and args.role == role
        assert args.model == spec.model.path and args.served_model_name == spec.model.served_name
        assert (args.host, args.port, args.kv_transport) == ("0.0.0.0", spec.role(role).port, "grpc")
        assert args.device == "cpu"
    prefill = parser.parse_args(build_worker_args(spec, spec.prefill))
    assert prefill.bootstrap_port == raw["prefill"]["bootstrapPort"]
    assert prefill.chunked_prefill_size == 256
