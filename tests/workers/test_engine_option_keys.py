"""The `--engine-opt` keys are one torch-free table (workers/serve/engine_option_keys.py), and every
entry point refuses a key that is not in it before a worker loads anything: `serve` (the CLI), `up`
(its `--worker-arg`s) and the operator (a role's engineArgs, tests/operator/test_engine_args.py).

Before: the key list came from the worker configs' fields, which only a torch-importing worker could
read, so a typo'd key was caught by the worker alone, after it had resolved its model directory; `up`
started every worker with it and the operator made pods that crash-looped on it.
"""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import typing

import pytest

from deepseek_pd.cli import main
from deepseek_pd.errors import UserError
from deepseek_pd.launcher.worker_plan import check_worker_args
from deepseek_pd.workers.serve.engine_option_keys import ENGINE_OPTION_KEYS, all_keys
from deepseek_pd.workers.serve.engine_options import assign_engine_options, parse_engine_options

pytestmark = pytest.mark.timeout(60)


def _seeded() -> random.Random:
    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    return random.Random(seed)


def _typo(rng: random.Random) -> tuple[str, str]:
    """(a real key, that key with two neighbouring letters swapped, which is no key)."""
    while True:
        key = rng.choice(all_keys())
        at = rng.randrange(len(key) - 1)
        wrong = key[:at] + key[at + 1] + key[at] + key[at + 2:]
        if wrong not in all_keys():
            return key, wrong


def _field_kind(cls: type, spec: dataclasses.Field) -> type:
    """How the config's own field would be parsed: its default's type, X of an `X | None` field."""
    default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
    if default is not None:
        return type(default)
    args = [arg for arg in typing.get_args(typing.get_type_hints(cls)[spec.name]) if arg is not type(None)]
    return args[0]


def test_the_table_is_every_config_field_serve_has_no_flag_for() -> None:
    """A field added to a worker config (or renamed, or retyped) without the table fails here."""
    from deepseek_pd.workers.serve.resolution import _FLAG_FIELDS, _TARGETS

    assert set(ENGINE_OPTION_KEYS) == set(_TARGETS)
    for target, cls in _TARGETS.items():
        fields = {spec.name: _field_kind(cls, spec) for spec in dataclasses.fields(cls)
                  if spec.init and spec.name not in _FLAG_FIELDS.get(target, ())}
        assert dict(ENGINE_OPTION_KEYS[target]) == fields, target


def test_values_are_parsed_as_their_fields_and_assigned_to_each_config_that_has_one() -> None:
    rng = _seeded()
    for _ in range(20):
        drawn = {}
        for key in rng.sample(all_keys(), rng.randint(1, 6)):
            kind = next(keys[key] for keys in ENGINE_OPTION_KEYS.values() if key in keys)
            drawn[key] = {bool: rng.random() < 0.5, int: rng.randint(0, 10 ** 6),
                          float: rng.uniform(0, 100), str: f"w{rng.randrange(10 ** 6)}"}[kind]
        items = [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in drawn.items()]
        parsed = parse_engine_options(items)
        assert parsed == drawn
        assigned = assign_engine_options(parsed)
        for target, keys in ENGINE_OPTION_KEYS.items():
            assert assigned[target] == {key: value for key, value in drawn.items() if key in keys}
    assert assign_engine_options(parse_engine_options(["deterministic=yes"]))["scheduler"] == {"deterministic": True}
    with pytest.raises(UserError, match="expected a int"):
        parse_engine_options(["max_running_requests=many"])


def test_serve_refuses_a_typo_before_it_looks_for_the_model(tmp_path, capsys) -> None:
    """The CLI names the unknown key and the one meant; the model directory (missing here) is not
    even looked at."""
    rng = _seeded()
    key, wrong = _typo(rng)
    role = rng.choice(["prefill", "decode"])
    code = main(["serve", role, "--model", str(tmp_path / "no-such-model"), "--device", "cpu",
                 "--engine-opt", f"{wrong}=1"])
    error = capsys.readouterr().err
    assert code == 2
    assert f"unknown --engine-opt {wrong!r} (did you mean {key}?)" in error, error


def test_up_refuses_a_typo_in_its_worker_args_before_any_worker_starts() -> None:
    rng = _seeded()
    key, wrong = _typo(rng)
    spelling = rng.choice([["--engine-opt", f"{wrong}=1"], [f"--engine-opt={wrong}=1"]])
    with pytest.raises(UserError, match=f"unknown --engine-opt '{wrong}'"):
        check_worker_args(["--num-pages=64", *spelling])
    with pytest.raises(UserError, match="--no-such-flag"):
        check_worker_args(["--no-such-flag"])
    check_worker_args(["--num-pages=64", "--engine-opt", f"{key}=1"])  # the key meant is taken


def test_the_table_imports_no_torch() -> None:
    code = ("import sys; from deepseek_pd.workers.serve.engine_options import parse_engine_options; "
            "from deepseek_pd.launcher.worker_plan import check_worker_args; "
            "parse_engine_options(['cuda_graph=false']); "
            "assert 'torch' not in sys.modules, 'the engine-option table imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
