"""The serve contract (workers/serve/flags.py) is the one definition of `deepseek-pd serve`'s
command line: every flag, set to a random value other than its default, renders and parses back
unchanged through the contract, the CLI's own parser, what `up` renders for its workers, what the
operator renders for its pods, and what the operator's memory plan reads. Any of them drifting
from the contract (a flag added to one only, a default or a spelling changed in one) fails here.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random
import re
import string

import pytest
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.launcher.worker_plan import (
    GroupShape, ServeSettings, plan_workers, port_block_sizes, serve_argv, serve_flags)
from deepseek_pd.model.kv.memory_budget import GpuShare
from deepseek_pd.operator.build_workers import build_worker_args, worker_serve_flags
from deepseek_pd.operator.crd_spec import MANAGED_FLAGS
from deepseek_pd.operator.engine_args import engine_args_violations
from deepseek_pd.operator.memory_flags import parse_memory_flags
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.workers.serve import flags as contract
from deepseek_pd.workers.serve.engine_option_keys import ENGINE_OPTION_KEYS
from deepseek_pd.workers.serve.flag_rules import GROUP_RUNNER_FIELDS, check_flags
from deepseek_pd.workers.serve.flags import ParallelFlags, ServeFlags

from pdtest.pod_inputs import expand

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _seeded() -> random.Random:
    seed = random.randrange(2 ** 32)
    print(f"seed {seed}")
    return random.Random(seed)


def _word(rng: random.Random) -> str:
    return rng.choice(string.ascii_lowercase) + "".join(rng.choices(string.ascii_lowercase + string.digits + ".:/_",
                                                                   k=rng.randint(0, 12)))


def _other_value(spec: dataclasses.Field, rng: random.Random):
    """A random value of the field's type that is not its default."""
    flag: contract.Flag = spec.metadata["flag"]
    default = spec.default
    if flag.choices:
        return rng.choice([c for c in flag.choices if c != default])
    if isinstance(default, bool):
        return True
    if spec.name == "engine_options":
        return tuple(_engine_option(rng) for _ in range(rng.randint(1, 3)))
    if isinstance(default, tuple):
        return tuple(_word(rng) for _ in range(rng.randint(1, 3)))
    kind = flag.type or type(default)
    if kind is int:
        return default + rng.randint(1, 5000) if default is not None else rng.randint(1, 5000)
    if kind is float:
        # In (0, 1) after rounding: from 0.01 a 1-digit rounding gave 0.0, a share the contract refuses
        # (a CI seed, 2084606074, drew it for --kv-share).
        return round(rng.uniform(0.1, 0.99), rng.randint(1, 6))
    return rng.choice(["-", ""]) + _word(rng)  # a value that starts with "-" must survive too


def _engine_option(rng: random.Random) -> str:
    """`KEY=VALUE` of a real engine option (workers/serve/engine_option_keys.py) with a value of its
    type; a number at least 1 (counts, sizes and timeouts are); a string setting one of its names.
    The fields the group layout sets are not drawn."""
    keys = [(key, kind) for target in ENGINE_OPTION_KEYS.values() for key, kind in target.items()
            if key not in GROUP_RUNNER_FIELDS]
    key, kind = rng.choice(keys)
    if isinstance(kind, tuple):
        return f"{key}={rng.choice(kind)}"
    value = {bool: lambda: rng.choice(["true", "false"]), int: lambda: str(rng.randint(1, 5000)),
             float: lambda: str(round(rng.uniform(1, 100), rng.randint(0, 4)))}[kind]()
    return f"{key}={value}"


def random_flags(rng: random.Random, keep=lambda spec: True) -> ServeFlags:
    """ServeFlags with every field `keep` selects set to a random non-default value."""
    values: dict[str, dict] = {"": {}, "parallel": {}}
    exclusive: set[str] = set()
    for owner, spec in contract._flag_fields():
        group = spec.metadata["flag"].exclusive
        if not keep(spec) or (group and group in exclusive):
            continue
        exclusive.add(group)
        values[owner][spec.name] = _other_value(spec, rng)
    return ServeFlags(role=rng.choice(["prefill", "decode"]), parallel=ParallelFlags(**values["parallel"]),
                      **values[""])


def _serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_every_flag_renders_and_parses_back_through_the_contract_and_the_cli() -> None:
    rng = _seeded()
    for _ in range(20):
        flags = random_flags(rng)
        argv = flags.to_argv()
        assert ServeFlags.from_argv(argv) == flags, argv
        assert flags_from_args(build_parser().parse_args(["serve", *argv])) == flags, argv
        assert ServeFlags.from_argv(flags.to_argv(always=[f.name for f in dataclasses.fields(ServeFlags)])) == flags
    assert ServeFlags(role="decode").to_argv() == ["decode"]  # defaults are not rendered
    assert ServeFlags.from_argv(["prefill"]) == ServeFlags(role="prefill")


def test_the_cli_has_exactly_the_contracts_flags() -> None:
    """A flag added to the CLI's `serve` beside the contract (or lost from it) is a drift."""
    options = {option for action in _serve_parser()._actions for option in action.option_strings}
    expected = {"--" + contract.cli_name(spec) for _, spec in contract._flag_fields()}
    assert options - {"-h", "--help"} == expected
    assert set(MANAGED_FLAGS) < {name[2:] for name in expected}  # the CRD's list is the contract's


def test_a_bad_command_line_is_a_value_error_naming_the_flag() -> None:
    for argv, words in ((["decode", "--num-pages", "many"], "--num-pages"), (["router"], "role"),
                        (["decode", "--no-such-flag"], "--no-such-flag"),
                        (["decode", "--num-pages", "4", "--max-total-tokens", "64"], "not allowed with")):
        with pytest.raises(ValueError, match=words):
            ServeFlags.from_argv(argv)


def test_up_renders_its_workers_through_the_contract(tmp_path) -> None:
    """What `up` plans for each worker is what that worker's `serve` parses: the whole ServeFlags,
    ports, group shape, memory share and prefill peers included; --worker-arg flags come last and win."""
    rng = _seeded()
    for _ in range(10):
        roles = [rng.choice(["prefill", "decode"]) for _ in range(rng.randint(2, 5))]
        shapes = [GroupShape(*rng.choice([(1, 1, 1), (2, 2, 2), (2, 1, 1), (4, 2, 4)]), rng.random() < 0.5)
                  for _ in roles]
        starts = [rng.randint(1024, 60000) for _ in port_block_sizes(shapes)]
        shares = [GpuShare(len(roles), rng.uniform(0.05, 1)) for _ in roles] if rng.random() < 0.5 else None
        extra = random_flags(rng, keep=lambda spec: not spec.metadata["flag"].shapes_group and rng.random() < 0.3)
        settings = ServeSettings(model_dir=str(tmp_path / _word(rng)), served_model_name=_word(rng), host="127.0.0.1",
                                 kv_transport=rng.choice(["grpc", "mooncake"]), device=rng.choice(["cpu", "cuda"]),
                                 secret_file=str(tmp_path / "secret"), worker_args=tuple(extra.to_argv()[1:]),
                                 mem_fraction_static=rng.choice([None, round(rng.uniform(0.1, 1), 3)]))
        plans = plan_workers(roles, shapes, starts, shares)
        for plan in plans:
            argv = serve_argv(plan, plans, settings)
            parsed = flags_from_args(build_parser().parse_args(argv[3:]))
            planned = serve_flags(plan, plans, settings)
            assert (planned.port, planned.bootstrap_port, planned.metrics_port) == (
                plan.port, plan.bootstrap_port, plan.metrics_port)
            assert planned.parallel == plan.shape.parallel_flags()
            if shares is not None:
                assert planned.gpu_share == plan.gpu_share
            # Every flag the worker args set wins; every other is what `up` planned.
            given = {spec.name for owner, spec in contract._flag_fields()
                     if getattr(extra.parallel if owner else extra, spec.name) != spec.default}
            for owner, spec in contract._flag_fields():
                source = extra if spec.name in given else planned
                if spec.name in ("engine_options", "bootstrap_aliases"):  # repeated flags add up
                    expected = getattr(planned, spec.name) + getattr(extra, spec.name)
                else:
                    expected = getattr(source.parallel if owner else source, spec.name)
                assert getattr(parsed.parallel if owner else parsed, spec.name) == expected, (spec.name, argv)


def _pod_env(spec: DeploymentSpec, role: str, rank: int) -> dict[str, str]:
    """What the kubelet puts in the $(VAR)s of a pod's arguments (build_workers._env)."""
    return {"LWS_WORKER_INDEX": str(rank), "LWS_LEADER_ADDRESS": f"{spec.name}-{role}-0-0.{spec.namespace}.svc",
            "DEEPSEEK_PD_POD_IP": "10.1.2.3", "DEEPSEEK_PD_POD_DNS_NAME": f"{spec.name}-{role}-0-{rank}.x.svc"}


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_the_operator_renders_its_pods_through_the_contract(example: str) -> None:
    """The pod's args, expanded as the kubelet does, parse back to the operator's ServeFlags with the
    role's engineArgs on top; the operator renders no flag the contract does not mark managed
    (but the EPLB placement it mounts), and the memory plan reads the engineArgs as the worker does.
    A draw that `serve`'s flag rules refuse (`--deterministic` with `--enable-tbo`, ...) is the
    operator's InvalidSpec condition and the memory plan's error, in serve's words."""
    rng = _seeded()
    raw = yaml.safe_load((EXAMPLES / example).read_text())["spec"]
    drawn = {role_name: random_flags(rng, keep=lambda spec: not spec.metadata["flag"].managed and rng.random() < 0.5
                                     and spec.name not in ("init_expert_location",))
             for role_name in ("prefill", "decode")}
    # One page size on both roles (or none): a difference is an InvalidSpec of its own (test_engine_args.py).
    drawn["decode"] = dataclasses.replace(drawn["decode"], page_size=drawn["prefill"].page_size)
    for role_name, extra in drawn.items():
        raw[role_name]["engineArgs"] = extra.to_argv()[1:]
    spec = DeploymentSpec.parse("demo", "llm", raw)
    for role in (spec.prefill, spec.decode):
        managed = worker_serve_flags(spec, role)
        for owner, field in contract._flag_fields():
            if getattr(managed.parallel if owner else managed, field.name) != field.default:
                assert field.metadata["flag"].managed or field.name == "init_expert_location", field.name
        for rank in range(role.size):
            env = _pod_env(spec, role.role, rank)
            args = [expand(arg, env) for arg in build_worker_args(spec, role)]
            assert args[0] == "serve"
            parsed = ServeFlags.from_argv(args[1:])
            engine = ServeFlags.from_argv([role.role, *role.engine_args])
            expected = {}
            for owner, field in contract._flag_fields():
                mine = getattr(managed.parallel if owner else managed, field.name)
                theirs = getattr(engine.parallel if owner else engine, field.name)
                if isinstance(mine, str):
                    mine = expand(mine, env)
                if isinstance(mine, tuple):
                    mine = tuple(expand(item, env) for item in mine)
                expected[field.name] = theirs if theirs != field.default else mine
            expected["node_rank"] = rank if role.size > 1 else 0
            assert {name: getattr(parsed.parallel if owner else parsed, name)
                    for owner, name in ((o, f.name) for o, f in contract._flag_fields())} == expected
            assert (parsed.port, parsed.kv_transport, parsed.model) == (role.port, spec.kv_transfer.backend,
                                                                        spec.model.path)
        # Draws serve refuses are an InvalidSpec condition in serve's words, and the memory plan refuses
        # them too; the rest it reads as the worker does.
        refused = {violation.field: violation.message for violation in engine_args_violations(spec)}
        assert refused.get(f"spec.{role.role}.engineArgs") == _refusal([*managed.to_argv(), *role.engine_args])
        if (why := _refusal([role.role, *role.engine_args])) is not None:
            with pytest.raises(ValueError, match=re.escape(why)):
                parse_memory_flags(role.role, list(role.engine_args))
        else:
            assert parse_memory_flags(role.role, list(role.engine_args)).serve == engine


def _refusal(argv: list[str]) -> str | None:
    """Why `serve` refuses this command line from its flags alone (workers/serve/flag_rules.py), or None."""
    try:
        check_flags(ServeFlags.from_argv(argv))
    except UserError as exc:
        return str(exc)
    return None


def _config_fields() -> dict[str, set[str]]:
    """The fields of each worker config that `--engine-opt` or a flag may set, by target."""
    from deepseek_pd.workers.serve.resolution import _TARGETS

    return {target: {f.name for f in dataclasses.fields(cls) if f.init} for target, cls in _TARGETS.items()}


def test_a_flag_that_names_a_config_field_is_that_engine_option_or_set_by_serve() -> None:
    """A flag named as a field of a worker config is either of kind `engine_option` (handed on by
    `all_engine_options`, and no engine option is withheld for it) or one serve resolves itself
    (its field withheld from the engine options). A flag passed on by hand beside the contract, as
    --enable-tbo, --speculative-num-steps and --deterministic once were, fails here."""
    from deepseek_pd.workers.serve.resolution import _FLAG_FIELDS

    fields = _config_fields()
    for _, spec in contract._flag_fields():
        targets = [target for target, names in fields.items() if spec.name in names]
        if spec.metadata["flag"].engine_option:
            assert targets, f"--{contract.cli_name(spec)} spells no engine option"
            assert not any(spec.name in _FLAG_FIELDS.get(target, ()) for target in targets), spec.name
        else:
            for target in targets:
                assert spec.name in _FLAG_FIELDS[target], (f"--{contract.cli_name(spec)} names {target}.{spec.name}: "
                                                           f"mark it engine_option or resolve it in serve")


def _checkpoint(tmp_path: pathlib.Path) -> str:
    """A config.json-only checkpoint with an MTP layer (resolution reads nothing else)."""
    import json

    from deepseek_pd.model.checkpoint.tiny import tiny_config

    config = {**tiny_config("v3", 512), "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_flag_of_kind_engine_option_means_its_engine_option_everywhere(tmp_path) -> None:
    """`--flag V` and `--engine-opt name=V` resolve to the same worker configs and give the operator's
    memory plan the same value; with both given the flag wins, for the worker and the memory plan."""
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    rng = _seeded()
    model = _checkpoint(tmp_path)
    kinds = [(owner, spec) for owner, spec in contract._flag_fields() if spec.metadata["flag"].engine_option]
    assert {spec.name for _, spec in kinds} >= {"enable_tbo", "speculative_num_steps", "deterministic"}
    for owner, spec in kinds:
        value = _other_value(spec, rng)
        if spec.name == "speculative_num_steps":
            value = rng.randint(1, 8)
        text = str(value).lower() if isinstance(value, bool) else str(value)
        role = rng.choice(["prefill", "decode"])
        base = ServeFlags(role=role, model=model, device="cpu")
        as_flag = (dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **{spec.name: value}))
                   if owner else dataclasses.replace(base, **{spec.name: value}))
        as_option = dataclasses.replace(base, engine_options=(f"{spec.name}={text}",))
        for flags in (as_flag, as_option):  # what `up` and the operator render, parsed as the worker does
            assert ServeFlags.from_argv(flags.to_argv()) == flags
            assert flags_from_args(build_parser().parse_args(["serve", *flags.to_argv()])) == flags
        resolved = resolve_serve_config(as_flag)
        assert resolved == resolve_serve_config(as_option), spec.name
        assert getattr(resolved.runner, spec.name) == value
        memory = [parse_memory_flags(role, flags.to_argv()[1:]) for flags in (as_flag, as_option)]
        if hasattr(memory[0], spec.name):
            assert getattr(memory[0], spec.name) == getattr(memory[1], spec.name) == value, spec.name
        # The default spelt as an option is overridden by the flag, as --engine-opt items come first.
        default_text = str(spec.default).lower() if isinstance(spec.default, bool) else str(spec.default)
        both = dataclasses.replace(as_flag, engine_options=(f"{spec.name}={default_text}",))
        assert getattr(resolve_serve_config(both).runner, spec.name) == value
        if hasattr(memory[0], spec.name):
            assert getattr(parse_memory_flags(role, both.to_argv()[1:]), spec.name) == value
