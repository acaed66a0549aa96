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
from deepseek_pd.launcher.worker_plan import GroupShape, check_worker_args
from deepseek_pd.workers.serve.engine_option_keys import ENGINE_OPTION_BOUNDS, ENGINE_OPTION_KEYS, all_keys, kind_of
from deepseek_pd.workers.serve.engine_options import assign_engine_options, parse_engine_options
from deepseek_pd.workers.serve.flag_rules import GROUP_RUNNER_FIELDS, check_flags
from deepseek_pd.workers.serve.flags import ServeFlags

pytestmark = pytest.mark.timeout(60)


def _seeded() -> random.Random:
    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    return random.Random(seed)


def _typo(rng: random.Random) -> tuple[str, str]:
    """(a real key that may be set directly, that key with two neighbouring letters swapped, which is
    no key)."""
    while True:
        key = rng.choice([key for key in all_keys() if key not in GROUP_RUNNER_FIELDS])
        at = rng.randrange(len(key) - 1)
        wrong = key[:at] + key[at + 1] + key[at] + key[at + 2:]
        if wrong not in all_keys():
            return key, wrong


def _valid_spelling(key: str) -> str:
    """A value of `key` that no flag rule refuses on either role: a string setting's first name, a
    bool's false (cuda_graph=true is refused on prefill), a number's 1 or its range's low end (one
    above it where the end itself is out, as for a timeout)."""
    kind = kind_of(key)
    if (bounds := ENGINE_OPTION_BOUNDS.get(key)) is not None:
        return str(bounds.low + 1 if bounds.open_low else bounds.low)
    return kind[0] if isinstance(kind, tuple) else "false" if kind is bool else "1"


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
        kinds = {key: str if isinstance(kind, tuple) else kind for key, kind in ENGINE_OPTION_KEYS[target].items()}
        assert kinds == fields, target


def test_values_are_parsed_as_their_fields_and_assigned_to_each_config_that_has_one() -> None:
    rng = _seeded()
    for _ in range(20):
        drawn = {}
        for key in rng.sample(all_keys(), rng.randint(1, 6)):
            kind = next(keys[key] for keys in ENGINE_OPTION_KEYS.values() if key in keys)
            if isinstance(kind, tuple):  # a string setting: one of its names
                drawn[key] = rng.choice(kind)
                continue
            bounds = ENGINE_OPTION_BOUNDS.get(key)  # a number within its config's range
            low, high = (bounds.low, min(bounds.high or 10 ** 6, 10 ** 6)) if bounds else (0, 10 ** 6)
            drawn[key] = {bool: lambda: rng.random() < 0.5, int: lambda: rng.randint(low, high),
                          float: lambda: rng.uniform(low, min(high, 100)) or high,
                          str: lambda: f"w{rng.randrange(10 ** 6)}"}[kind]()
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
    check_worker_args(["--num-pages=64", "--engine-opt", f"{key}={_valid_spelling(key)}"])  # the key meant is taken


def test_up_refuses_worker_args_a_worker_of_either_role_refuses_in_its_words() -> None:
    """`up` applies `serve`'s flag rules to its --worker-args for each role, with that role's group
    shape, as the operator does to engineArgs. Before: it checked the keys and their types only, so
    an argument one role refuses (cuda_graph=true on prefill, ...) started every worker, and that
    role's workers refused it on each restart while `up` waited for them."""
    rng = _seeded()
    cases = [["--engine-opt=cuda_graph=true"],
             ["--deterministic", "--engine-opt", f"prefix_cache={rng.choice(['true', '1', 'yes'])}"],
             [f"--{rng.choice(['num-pages', 'max-total-tokens'])}={-rng.randint(0, 64)}"],
             ["--engine-opt", f"speculative_num_steps={rng.randint(9, 64)}"],
             ["--engine-opt", f"{rng.choice(GROUP_RUNNER_FIELDS)}={rng.randint(1, 4)}"]]
    for args in rng.sample(cases, len(cases)):
        refusals = []
        for role in ("prefill", "decode"):
            try:
                check_flags(ServeFlags.from_argv([role, *args]))
            except UserError as exc:
                refusals.append(str(exc))
        assert refusals, args
        with pytest.raises(UserError) as up:
            check_worker_args(args)
        assert str(up.value) in refusals, (args, up.value)
    ranks = rng.choice([2, 4])  # attention TP over all the ranks: no two-batch overlap
    with pytest.raises(UserError, match="two-batch overlap"):
        check_worker_args(["--engine-opt=enable_tbo=true"], {"decode": GroupShape(ranks=ranks, dp=1, ep=ranks)})
    check_worker_args(["--engine-opt=enable_tbo=true"], {"decode": GroupShape(ranks=ranks, dp=ranks, ep=ranks)})


def _choice_keys() -> list[str]:
    """The keys of string settings, which take one of a few names (a backend, a mode)."""
    return [key for key in all_keys() if isinstance(kind_of(key), tuple)]


def _not_a_choice(rng: random.Random, choices: tuple[str, ...]) -> str:
    """A value near a valid one (a case, a letter more or less) or plain junk, and none of `choices`."""
    while True:
        near = rng.choice(choices)
        value = rng.choice([near.upper(), near[:-1], near + rng.choice("s_x1"), f"w{rng.randrange(10 ** 6)}"])
        if value not in choices:
            return value


def test_a_string_setting_outside_its_names_is_refused_before_any_worker_naming_them(tmp_path, capsys) -> None:
    """`up`'s worker args, `serve` (the CLI, before it looks for the model) and the option parser the
    operator applies refuse a backend or mode name no config takes, listing the names, in the words
    the worker's own config (`RunnerConfig`, `TransportConfig`) refuses it in (the one rule,
    deepseek_pd/choices.py). Before: any string passed them all; the worker refused it alone, after it
    had loaded its checkpoint or at its first transfer."""
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.workers.transport.base import TransportConfig

    rng = _seeded()
    assert _choice_keys(), "no string settings in the table"
    for key in _choice_keys():
        choices = kind_of(key)
        bad = _not_a_choice(rng, choices)
        with pytest.raises(UserError) as parsed:
            parse_engine_options([f"{key}={bad}"])
        assert all(name in str(parsed.value) for name in choices), parsed.value
        with pytest.raises(UserError) as up:
            check_worker_args(rng.choice([["--engine-opt", f"{key}={bad}"], [f"--engine-opt={key}={bad}"]]))
        assert str(up.value) == str(parsed.value)
        worker = RunnerConfig if key in ENGINE_OPTION_KEYS["runner"] else TransportConfig
        with pytest.raises((UserError, ValueError)) as built:
            worker(**{key: bad})
        assert str(built.value) == str(parsed.value), (key, bad)
        good = rng.choice(choices)
        assert parse_engine_options([f"{key}={good}"]) == {key: good}
    key = rng.choice(_choice_keys())
    bad = _not_a_choice(rng, kind_of(key))
    code = main(["serve", rng.choice(["prefill", "decode"]), "--model", str(tmp_path / "no-such-model"),
                 "--device", "cpu", "--engine-opt", f"{key}={bad}"])
    error = capsys.readouterr().err
    assert code == 2
    assert f"{key} {bad!r} is not one of {', '.join(kind_of(key))}" in error, error


def _config_refusal(key: str, value: float) -> str:
    """What the worker's own config that holds `key` says when built with `value`."""
    from deepseek_pd.model.runner_config import RunnerConfig
    from deepseek_pd.workers.engine.scheduler_config import SchedulerConfig
    from deepseek_pd.workers.group.layout import GroupLayout
    from deepseek_pd.workers.transport.base import TransportConfig
    from deepseek_pd.workers.transport.bootstrap_config import BootstrapConfig

    configs = {"runner": RunnerConfig, "scheduler": SchedulerConfig, "transport": TransportConfig,
               "bootstrap": BootstrapConfig, "group": GroupLayout}
    (target,) = [target for target, keys in ENGINE_OPTION_KEYS.items() if key in keys]
    with pytest.raises((UserError, ValueError)) as built:
        configs[target](**{key: value})
    return str(built.value)


def test_a_number_option_out_of_its_range_is_refused_before_any_worker_in_the_configs_words(tmp_path, capsys):
    """`up`'s worker args, `serve` (the CLI, before it looks for the model) and the option parser the
    operator applies refuse a numeric engine option outside the range its worker config takes, in
    the words that config refuses it in (the one rule, deepseek_pd/bounds.py, over the configs' own
    bounds); a value at a closed bound is taken by both. Before: any number passed them all, and the
    worker refused it alone, after it had loaded its checkpoint (max_running_requests=0,
    grpc_streams=17, send_timeout_s=0, ...)."""
    rng = _seeded()
    assert ENGINE_OPTION_BOUNDS and all(kind_of(key) in (int, float) for key in ENGINE_OPTION_BOUNDS)
    for key, bounds in ENGINE_OPTION_BOUNDS.items():
        kind = kind_of(key)
        below = bounds.low - (rng.randint(0 if bounds.open_low else 1, 1 << 20))
        bad = rng.choice([below, bounds.high + rng.randint(1, 1 << 20)]) if bounds.high is not None else below
        with pytest.raises(UserError) as parsed:
            parse_engine_options([f"{key}={bad}"])
        assert str(parsed.value) == _config_refusal(key, kind(bad)), (key, bad)
        with pytest.raises(UserError) as up:
            check_worker_args(rng.choice([["--engine-opt", f"{key}={bad}"], [f"--engine-opt={key}={bad}"]]))
        assert str(up.value) == str(parsed.value)
        edges = [bounds.low] * (not bounds.open_low) + [bounds.high] * (bounds.high is not None)
        edge = rng.choice(edges or [bounds.low + 1])
        assert parse_engine_options([f"{key}={edge}"]) == {key: kind(edge)}
    key = rng.choice(sorted(ENGINE_OPTION_BOUNDS))
    bad = kind_of(key)(ENGINE_OPTION_BOUNDS[key].low - 1)
    code = main(["serve", rng.choice(["prefill", "decode"]), "--model", str(tmp_path / "no-such-model"),
                 "--device", "cpu", "--engine-opt", f"{key}={bad}"])
    error = capsys.readouterr().err
    assert code == 2
    assert f"{key} must be " in error and f"got {bad}" in error, error


def test_the_table_imports_no_torch() -> None:
    code = ("import sys; from deepseek_pd.workers.serve.engine_options import parse_engine_options; "
            "from deepseek_pd.launcher.worker_plan import check_worker_args; "
            "parse_engine_options(['cuda_graph=false']); "
            "assert 'torch' not in sys.modules, 'the engine-option table imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
