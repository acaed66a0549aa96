"""A CR whose engineArgs its workers would refuse at start-up is an InvalidSpec condition naming
`spec.<role>.engineArgs` in the worker's own words, and the operator creates nothing (operator/engine_args.py).

Before: the operator checked only the memory flags (and only once the model and GPU were known), so
such a CR got its StatefulSets and its pods crash-looped on `serve`'s refusal. The oracle is the
worker itself: `resolve_serve_config` on the same flags refuses with the message the condition shows."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import random
import subprocess
import sys
import uuid

import pytest
import yaml
from memory_api import MemoryApi

from deepseek_pd.errors import UserError
from deepseek_pd.operator.build_workers import worker_serve_flags
from deepseek_pd.operator.engine_args import engine_args_violations
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.workers.serve.engine_option_keys import ENGINE_OPTION_BOUNDS, all_keys, kind_of
from deepseek_pd.workers.serve.flags import ServeFlags
from deepseek_pd.workers.serve.resolution import resolve_serve_config

pytestmark = pytest.mark.timeout(60)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
LOG = logging.getLogger("test")


def _body(example: str) -> dict:
    body = yaml.safe_load((EXAMPLES / example).read_text())
    body["metadata"].update(namespace="llm", uid=str(uuid.uuid4()), generation=1)
    return body


def _tbo_under_attention_tp(spec: dict) -> str:
    spec["decode"]["parallelism"] = {"tp": 2, "dp": 16, "ep": 32}
    spec["decode"]["engineArgs"] = ["--enable-tbo"]
    return "decode"


def _graphs_on_prefill(spec: dict) -> str:
    spec["prefill"]["engineArgs"] = [*spec["prefill"].get("engineArgs", []), "--engine-opt=cuda_graph=true"]
    return "prefill"


def _deterministic_with_the_prefix_cache(spec: dict) -> str:
    role = random.choice(["prefill", "decode"])
    spec[role]["engineArgs"] = ["--deterministic", "--engine-opt", "prefix_cache=true"]
    return role


def _both_pool_sizes(spec: dict) -> str:
    role = random.choice(["prefill", "decode"])
    pages = random.randint(1, 64)
    spec[role]["engineArgs"] = [f"--num-pages={pages}", f"--max-total-tokens={pages * 16}"]
    return role


def _graphs_with_expert_load_recording(spec: dict) -> str:
    spec["decode"]["engineArgs"] = ["--engine-opt", "record_expert_load=true", "--engine-opt", "cuda_graph=1"]
    return "decode"


def typo(rng: random.Random) -> tuple[str, str]:
    """(a real --engine-opt key, that key with two neighbouring letters swapped: no key at all)."""
    keys = all_keys()
    while True:
        key = rng.choice(keys)
        at = rng.randrange(len(key) - 1)
        wrong = key[:at] + key[at + 1] + key[at] + key[at + 2:]
        if wrong not in keys:
            return key, wrong


def _typo_key(spec: dict) -> str:
    role = random.choice(["prefill", "decode"])
    spec[role]["engineArgs"] = [*spec[role].get("engineArgs", []), f"--engine-opt={typo(random)[1]}=1"]
    return role


def _not_a_backend_name(spec: dict) -> str:
    """A string setting (a backend, a mode) set to a name none of the worker's configs take."""
    role = random.choice(["prefill", "decode"])
    key = random.choice([key for key in all_keys() if isinstance(kind_of(key), tuple)])
    spec[role]["engineArgs"] = [*spec[role].get("engineArgs", []), f"--engine-opt={key}=w{random.randrange(10 ** 6)}"]
    return role


def _integer_out_of_range(spec: dict) -> str:
    """A numeric engine option below its config's range (deepseek_pd/bounds.py)."""
    role = random.choice(["prefill", "decode"])
    key = random.choice(sorted(ENGINE_OPTION_BOUNDS))
    value = ENGINE_OPTION_BOUNDS[key].low - random.randint(1, 64)
    spec[role]["engineArgs"] = [*spec[role].get("engineArgs", []), f"--engine-opt={key}={value}"]
    return role


def _too_many_speculative_steps(spec: dict) -> str:
    spec["decode"]["engineArgs"] = ["--engine-opt", f"speculative_num_steps={random.randint(9, 64)}"]
    return "decode"


CASES = {  # name: (example, the change, words of the worker's refusal)
    "tbo_tp": ("deepseek-v3-h200.yaml", _tbo_under_attention_tp, "two-batch overlap"),
    "graphs_prefill": ("cpu-minimal.yaml", _graphs_on_prefill, "never decodes"),
    "graphs_prefill_h200": ("deepseek-v3-h200.yaml", _graphs_on_prefill, "never decodes"),
    "deterministic_cache": ("cpu-minimal.yaml", _deterministic_with_the_prefix_cache, "prefix cache"),
    "pool_sizes": ("cpu-minimal.yaml", _both_pool_sizes, "not allowed with argument --num-pages"),
    "graphs_expert_load": ("deepseek-v3-h200.yaml", _graphs_with_expert_load_recording, "record_expert_load"),
    "typo_key": ("cpu-minimal.yaml", _typo_key, "unknown --engine-opt"),
    "typo_key_h200": ("deepseek-v3-h200.yaml", _typo_key, "unknown --engine-opt"),
    "backend_name": ("cpu-minimal.yaml", _not_a_backend_name, "is not one of"),
    "speculative_steps": ("cpu-minimal.yaml", _too_many_speculative_steps, "--speculative-num-steps must be"),
    "option_range": ("cpu-minimal.yaml", _integer_out_of_range, " must be "),
}


def _worker_refusal(spec: DeploymentSpec, role_name: str) -> str:
    """What the worker itself says when started with this role's command line: its parser, then
    `resolve_serve_config` (here on the CPU with the tiny model: the flags' own rules come first,
    whatever the checkpoint and the device)."""
    role = spec.prefill if role_name == "prefill" else spec.decode
    argv = [*worker_serve_flags(spec, role).to_argv(), *role.engine_args]
    with pytest.raises((UserError, ValueError)) as refused:
        flags = ServeFlags.from_argv(argv)
        resolve_serve_config(dataclasses.replace(flags, model="tiny", device="cpu"))
    return str(refused.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_args_the_worker_refuses_are_an_invalid_spec_and_create_nothing(case):
    example, change, words = CASES[case]
    body = _body(example)
    role = change(body["spec"])
    api = MemoryApi()
    status = asyncio.run(Reconciler(api).reconcile(body, LOG))
    assert api.writes == [], "children were created for a spec its workers refuse"
    assert status["phase"] == "Failed", status
    message = next(c for c in status["conditions"] if c["type"] == "InvalidSpec")["message"]
    refusal = _worker_refusal(DeploymentSpec.parse("x", "llm", body["spec"]), role)
    assert words in refusal
    assert f"spec.{role}.engineArgs: {refusal}" in message, (message, refusal)


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_the_examples_engine_args_pass(example):
    body = _body(example)
    assert engine_args_violations(DeploymentSpec.parse("x", "llm", body["spec"])) == []


def test_a_flag_serve_does_not_know_is_named():
    body = _body("cpu-minimal.yaml")
    body["spec"]["decode"]["engineArgs"] = ["--no-such-flag"]
    violations = engine_args_violations(DeploymentSpec.parse("x", "llm", body["spec"]))
    assert [v.field for v in violations] == ["spec.decode.engineArgs"]
    assert "--no-such-flag" in violations[0].message


def test_the_check_imports_no_torch():
    code = ("import sys, yaml; from deepseek_pd.operator.engine_args import engine_args_violations; "
            "from deepseek_pd.operator.spec import DeploymentSpec; "
            f"raw = yaml.safe_load(open({str(EXAMPLES / 'deepseek-v3-h200.yaml')!r}))['spec']; "
            "raw['prefill']['engineArgs'] = ['--engine-opt=cuda_graph=true']; "
            "assert engine_args_violations(DeploymentSpec.parse('x', 'llm', raw)); "
            "assert 'torch' not in sys.modules, 'the engine-args check imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_page_sizes_that_could_differ_between_the_roles_are_an_invalid_spec(example):
    """Each worker would start, and every request's KV transfer would fail on the layout check
    (tests/workers/test_pd_page_size_mismatch.py): --page-size on one role only, or two different."""
    size = random.choice([16, 32, 64])
    prefill, decode = random.choice([(size, None), (None, size), (size, size * 2)])
    body = _body(example)
    for role, given in (("prefill", prefill), ("decode", decode)):
        body["spec"][role]["engineArgs"] = [*body["spec"][role].get("engineArgs", []),
                                            *([f"--page-size={given}"] if given else [])]
    api = MemoryApi()
    status = asyncio.run(Reconciler(api).reconcile(body, LOG))
    assert api.writes == [] and status["phase"] == "Failed", status
    message = next(c for c in status["conditions"] if c["type"] == "InvalidSpec")["message"]
    assert "spec.decode.engineArgs: prefill and decode must hold KV pages of one size" in message, message
    for role in ("prefill", "decode"):  # the same page on both is fine
        body["spec"][role]["engineArgs"] = [arg for arg in body["spec"][role]["engineArgs"]
                                            if not arg.startswith("--page-size")] + [f"--page-size={size}"]
    assert engine_args_violations(DeploymentSpec.parse("x", "llm", body["spec"])) == []
