"""A deployment on Mooncake may not put a worker pod's ports where Mooncake's engines bind their own
at random (deepseek_pd.env.MOONCAKE_RPC_PORTS): the CRD rule refuses it, naming the range, and
the same spec on the gRPC KV path (no Mooncake engine) is accepted."""
from __future__ import annotations

import pathlib
import random

import pytest
import yaml

from deepseek_pd.env import MOONCAKE_RPC_PORTS
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
LOW, HIGH = MOONCAKE_RPC_PORTS.start, MOONCAKE_RPC_PORTS.stop


def _spec(rng: random.Random) -> dict:
    raw = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())["spec"]
    raw["kvTransfer"] = {**raw.get("kvTransfer", {}), "backend": "mooncake"}
    raw["metrics"] = {"port": rng.randrange(20000, 29000), "routerPort": rng.randrange(40000, 50000)}
    return raw


def _parse(raw: dict) -> DeploymentSpec:
    return DeploymentSpec.parse("v3", "llm", raw)


@pytest.mark.parametrize("field", ["prefill.port", "prefill.bootstrapPort", "decode.port", "metrics.port"])
def test_a_worker_port_in_mooncakes_range_is_refused_with_mooncake_only(field: str) -> None:
    rng = random.Random()
    raw = _spec(rng)
    _parse(raw)  # the example's own ports are clear
    section, key = field.split(".")
    if section == "metrics":  # a run of per-rank ports that only reaches into the range
        ranks = max(raw["prefill"]["gpusPerPod"], raw["decode"]["gpusPerPod"], 1)
        raw["metrics"]["port"] = LOW - rng.randrange(1, ranks + 1) + 1 if ranks > 1 and rng.random() < 0.5 \
            else rng.randrange(LOW, HIGH)
    else:
        raw[section][key] = rng.randrange(LOW, HIGH)
    with pytest.raises(InvalidSpecError, match=f"outside {LOW}-{HIGH - 1}"):
        _parse(raw)
    raw["kvTransfer"]["backend"] = "grpc"
    raw["kvTransfer"].pop("protocol", None)
    raw["kvTransfer"].pop("devices", None)
    _parse(raw)


def test_ports_just_outside_the_range_are_accepted() -> None:
    rng = random.Random()
    raw = _spec(rng)
    raw["prefill"]["port"], raw["decode"]["port"] = LOW - 1, HIGH
    raw["prefill"]["bootstrapPort"] = rng.choice([LOW - 2, HIGH + 1])
    _parse(raw)
