"""One seed per pytest run, and from it one seed per test: every random draw in the test process
replays from the run seed (pytest plugin, loaded by tests/conftest.py).

    pytest tests ...                        a fresh run seed, printed first: "random seed: 123..."
    pytest --seed 123 tests ...             replays that run (DEEPSEEK_PD_TEST_SEED=123 does too)
    pytest --seed 123 'tests/x.py::test_y'  replays that one test alone: its seed depends only on
                                            (run seed, node id), not on which tests ran before it

Before each test (its setup; again, from a seed of its own, before its call, so a fixture set up
for it by an earlier test changes none of its own draws) the test's seed is applied to Python's `random`
module, numpy's and torch's global generators, and to every `random.Random()` made without a seed
(the suite's usual `rng = random.Random()`): such an instance takes its seed from a stream of the
test's seed instead of the OS. Explicit seeds (`random.Random(7)`, `torch.Generator().manual_seed`)
are left alone. Collection gets a seed of its own (a parametrization drawn at import replays).
Patching the unseeded constructor, rather than rewriting ~300 call sites, keeps tests written
tomorrow seeded too. Subprocesses draw their own, so a test passes a seed drawn here to what it
spawns. Left to the OS on purpose: credentials of the test control plane (tests/k8s/pki.py) and
the uids the emulated API server assigns (identities, not inputs).

Hypothesis has two profiles (`--hypothesis-profile`):
- "ci", the default: derandomized. Each property test's examples are a function of its own code,
  the same on every run, so CI cannot pass or fail by the draw; a failure prints the blob that
  replays it (`@reproduce_failure`). No example database: nothing left on disk changes a run.
- "fuzz" (`make fuzz`): `examples(n)` gives FUZZ_FACTOR times more examples, seeded by the run
  seed (so `--seed` replays a fuzz run too), fresh seeds by default.
A failing test's report gets a "random seed" section with the command that replays it.
"""
from __future__ import annotations

import hashlib
import os
import random
import secrets
from typing import Any, Iterator

import pytest

SEED_ENV = "DEEPSEEK_PD_TEST_SEED"
PROFILE_CI = "ci"
PROFILE_FUZZ = "fuzz"
FUZZ_FACTOR = 20
_SEED_BITS = 63


def node_seed(run_seed: int, nodeid: str) -> int:
    """A test's seed: a hash of the run seed and its node id (stable across Python processes,
    unlike `hash()`), so a test replays alone with the run's seed."""
    digest = hashlib.sha256(f"{run_seed}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - _SEED_BITS)


def examples(n: int) -> int:
    """A property test's example budget: `n` under "ci", FUZZ_FACTOR * n under "fuzz"."""
    from hypothesis import settings

    return n * FUZZ_FACTOR if settings.get_current_profile_name() == PROFILE_FUZZ else n


class _UnseededRandom:
    """While a test runs, `random.Random()` without a seed draws its seed from `stream`, a
    `random.Random` of the test's seed, instead of the OS."""

    def __init__(self) -> None:
        self.stream: random.Random | None = None
        self._original = random.Random.seed

    def install(self) -> None:
        original, owner = self._original, self

        def seed(rng: random.Random, a: Any = None, version: int = 2) -> None:
            if a is None and owner.stream is not None and rng is not owner.stream:
                a = owner.stream.getrandbits(128)
            original(rng, a, version)

        random.Random.seed = seed  # type: ignore[method-assign]

    def uninstall(self) -> None:
        random.Random.seed = self._original  # type: ignore[method-assign]


_UNSEEDED = _UnseededRandom()


def _apply(seed: int) -> None:
    import numpy
    import torch

    _UNSEEDED.stream = random.Random(seed)
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _run_seed(config: pytest.Config) -> int:
    seed = config.getoption("seed")
    if seed is None:
        seed = os.environ.get(SEED_ENV) or None
    if seed is None:
        return secrets.randbits(32)  # short enough to type back
    try:
        return int(seed)
    except ValueError:
        raise pytest.UsageError(f"--seed / {SEED_ENV} takes an integer, not {seed!r}") from None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("seeding").addoption(
        "--seed", type=str, default=None,
        help=f"the run's random seed (default: ${SEED_ENV}, else fresh); replays a printed run")


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own pytest_configure reads its options
def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import HealthCheck, settings

    config.stash[_RUN_SEED] = run_seed = _run_seed(config)
    # Timing rules fail by the machine's load, not by the code: none in either profile.
    common = dict(deadline=None, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile(PROFILE_CI, derandomize=True, **common)
    settings.register_profile(PROFILE_FUZZ, derandomize=False, **common)
    if not config.getoption("hypothesis_profile", None):
        config.option.hypothesis_profile = PROFILE_CI
    if config.option.hypothesis_profile == PROFILE_FUZZ and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(run_seed)
    _UNSEEDED.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _UNSEEDED.uninstall()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under "fuzz" a property test draws FUZZ_FACTOR times more examples, so it gets FUZZ_FACTOR
    times its timeout (the seed-12 fuzz run of test_cr_fuzz died at its 600 s, not on a bug)."""
    if config.option.hypothesis_profile != PROFILE_FUZZ:
        return
    for item in items:
        if item.get_closest_marker("hypothesis") is None:
            continue
        marker = item.get_closest_marker("timeout")
        base = marker.args[0] if marker is not None and marker.args else config.getini("timeout")
        if base:
            item.add_marker(pytest.mark.timeout(float(base) * FUZZ_FACTOR), append=False)


_RUN_SEED = pytest.StashKey[int]()


def _replay_args(config: pytest.Config) -> str:
    """The options that replay this run's draws: its seed, and a profile other than "ci"."""
    profile = config.option.hypothesis_profile
    return f"--seed {config.stash[_RUN_SEED]}" + ("" if profile == PROFILE_CI else f" --hypothesis-profile {profile}")


def seed_line(config: pytest.Config) -> str:
    profile = config.option.hypothesis_profile
    hypothesis = ("hypothesis derandomized (profile ci)" if profile == PROFILE_CI
                  else f"hypothesis profile {profile}, seeded by the run seed")
    return f"random seed: {config.stash[_RUN_SEED]} (replay: pytest {_replay_args(config)} ...; {hypothesis})"


def pytest_report_header(config: pytest.Config) -> str:
    return seed_line(config)


@pytest.hookimpl(trylast=True)  # after the terminal reporter's own session start
def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and reporter.verbosity < 0:  # -q hides the header: say it anyway
        reporter.write_line(seed_line(session.config))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        terminalreporter.write_line(seed_line(config))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Draws at import time (a parametrization drawn at random) replay too: the node ids do."""
    _apply(node_seed(session.config.stash[_RUN_SEED], "<collection>"))
    try:
        return (yield)
    finally:
        _UNSEEDED.stream = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _apply(node_seed(item.config.stash[_RUN_SEED], item.nodeid))
    try:
        return (yield)
    finally:
        _UNSEEDED.stream = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The test's own draws start afresh once its fixtures are set up, from a seed of their own:
    a module or session fixture is set up inside the first test that uses it and draws from that
    test's stream, so without this a test drew other inputs alone than after its module's first
    test (run 2114677491: a failure that passed alone, taken for a flake). Its own seed, not the
    set-up's again, so its draws stay independent of a function fixture's."""
    _apply(node_seed(item.config.stash[_RUN_SEED], f"{item.nodeid}#call"))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        run_seed = item.config.stash[_RUN_SEED]
        report.sections.append(("random seed", f"run seed {run_seed}, this test's seed "
                                f"{node_seed(run_seed, item.nodeid)}; replay: "
                                f"pytest {_replay_args(item.config)} '{item.nodeid}'"))
    return report
