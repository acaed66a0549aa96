"""The memory settings' ranges are one rule (model/runner_rules.py `sizing_blocker`): `RunnerConfig`
and `serve`'s flag rules (workers/serve/flag_rules.py, which the operator applies to engineArgs and its
memory plan through them) refuse the same values with the same words.

Before: the runner, and a copy in the operator's memory plan with words of its own, checked them;
`serve` let them through to the runner, after it had read the checkpoint."""
from __future__ import annotations

import pathlib
import random
import re

import pytest

from deepseek_pd.errors import UserError
from deepseek_pd.model.runner_config import RunnerConfig
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.serve.flags import ServeFlags


def _bad_settings(rng: random.Random) -> list[tuple[dict, list[str]]]:
    """(RunnerConfig fields, the same as `serve` flags) for one out-of-range value of each setting."""
    fraction = rng.choice([round(rng.uniform(1.01, 3), 2), -round(rng.uniform(0, 1), 2), 0.0])
    share = rng.choice([0.0, round(rng.uniform(1.01, 2), 2)])
    headroom = -round(rng.uniform(0.1, 8), 1)
    redundant = -rng.randint(1, 8)
    return [({"page_size": -rng.randint(0, 64)}, None),
            ({"mem_fraction_static": fraction, "num_pages": None}, [f"--mem-fraction-static={fraction}"]),
            ({"mem_headroom_gib": headroom}, ["--engine-opt", f"mem_headroom_gib={headroom}"]),
            ({"kv_share": share}, [f"--kv-share={share}"]),
            ({"gpu_workers": -rng.randint(0, 4)}, None),
            ({"ep_num_redundant_experts": redundant}, [f"--ep-num-redundant-experts={redundant}"]),
            ({"fp8_backend": "fp8_" + str(rng.randrange(100))}, None)]


def test_the_runner_and_serve_refuse_the_same_memory_settings_in_the_same_words() -> None:
    rng = random.Random(random.randrange(2 ** 32))
    for fields, argv in _bad_settings(rng):
        (name, value), *_ = fields.items()
        if argv is None:  # spelt as its own flag, or as an engine option
            flag = {"page_size": "--page-size", "gpu_workers": "--gpu-workers"}.get(name)
            argv = [f"{flag}={value}"] if flag else ["--engine-opt", f"{name}={value}"]
        with pytest.raises(UserError) as runner:
            RunnerConfig(**fields)
        with pytest.raises(UserError) as serve:
            check_flags(ServeFlags.from_argv([rng.choice(["prefill", "decode"]), *argv]))
        assert str(serve.value) == str(runner.value), (fields, argv)
        assert str(value) in str(serve.value), serve.value


def _registered(registry: str) -> set[str]:
    """The names model/ registers in `registry` anywhere, whether or not its library is installed
    here ("grouped", "deep_gemm", "deepep" register only where it is)."""
    model = pathlib.Path(__file__).resolve().parents[2] / "model"
    pattern = re.compile(rf'\b{registry}\.register\("(\w+)"\)')
    return {name for path in model.rglob("*.py") for name in pattern.findall(path.read_text())}


def test_the_runner_choices_are_the_names_its_registries_and_enums_hold() -> None:
    """`RUNNER_CHOICES`, which `serve`, `up` and the operator check a string setting against before a
    worker starts, drifts from what the model can build: a backend registered or renamed without it
    fails here."""
    from deepseek_pd.model.distributed.dispatch_mode import DispatchMode
    from deepseek_pd.model.forward_batch import AttentionMethod
    from deepseek_pd.model.runner_rules import RUNNER_CHOICES

    assert set(RUNNER_CHOICES["attention_backend"]) == {"auto"} | _registered("ATTENTION_BACKENDS")
    assert set(RUNNER_CHOICES["moe_backend"]) == {"auto"} | _registered("MOE_BACKENDS")
    assert set(RUNNER_CHOICES["dispatcher"]) == {"auto"} | _registered("DISPATCHERS")
    assert set(RUNNER_CHOICES["norm_rope_backend"]) == {"auto"} | _registered("NORM_ROPE_BACKENDS")
    assert set(RUNNER_CHOICES["fp8_backend"]) == {"auto", "dequant"} | _registered("FP8_GEMM_BACKENDS")
    assert set(RUNNER_CHOICES["dispatch_mode"]) == {mode.value for mode in DispatchMode}
    assert set(RUNNER_CHOICES["attention_method"]) == {"auto"} | {method.value for method in AttentionMethod}
    assert _registered("MOE_BACKENDS") >= {"torch", "triton", "grouped", "deep_gemm"}  # the scan sees the optional ones


def test_the_dtype_choices_are_what_the_runner_builds_and_serve_offers():
    """`--dtype` has one list (model/config.py DTYPE_CHOICES): serve's parser offers it, and
    RunnerConfig takes each of its values and refuses anything else naming them."""
    from deepseek_pd.model.config import DTYPE_CHOICES
    from deepseek_pd.model.runner_config import _DTYPES

    assert set(DTYPE_CHOICES) == {"auto", *_DTYPES}
    rng = random.Random()
    for name in DTYPE_CHOICES:
        assert ServeFlags.from_argv(["decode", "--dtype", name]).dtype == RunnerConfig(dtype=name).dtype == name
    bad = rng.choice([f"int{rng.choice([4, 8])}", "fp8", rng.choice(DTYPE_CHOICES).upper()])
    with pytest.raises(UserError, match=f"dtype '{bad}' is not one of {', '.join(DTYPE_CHOICES)}"):
        RunnerConfig(dtype=bad)
    with pytest.raises(ValueError, match="--dtype"):
        ServeFlags.from_argv(["decode", "--dtype", bad])
