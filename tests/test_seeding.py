"""The seed plugin (tests/support/pdtest/seeding.py) on a small suite of its own, run by pytest in
a subprocess: the same run seed replays every draw (Python's `random`, an unseeded
`random.Random()`, numpy, torch, a parametrization drawn at collection, and hypothesis under
"fuzz"), a test replays alone, another seed
draws otherwise, "ci" hypothesis does not depend on the seed, and the seed is printed first under
`-q` and in a failing test's report with the command that replays it."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Callable

import pytest

from pdtest.seeding import FUZZ_FACTOR, SEED_ENV

SUPPORT = pathlib.Path(__file__).resolve().parent / "support"
SUITE = '''
import json, os, random
import numpy, pytest, torch
from hypothesis import given, settings, strategies as st
from pdtest.seeding import examples

def _record(name, value):
    with open(os.environ["DRAWS_OUT"], "a") as out:
        out.write(json.dumps([name, value]) + "\\n")

def _draws():
    return [random.random(), random.Random().random(), random.Random().random(),
            float(numpy.random.rand()), torch.rand(1).item()]

@pytest.fixture(scope="module")
def shared():
    return random.Random().random()  # a module fixture's set-up draws, in the first test that uses it

def test_m1(shared):
    _record("m1", _draws())

def test_m2(shared):
    _record("m2", _draws())

def test_a():
    _record("a", _draws())

def test_b():
    _record("b", _draws())

@settings(max_examples=examples(5))
@given(st.integers(0, 2**64))
def test_h(x):
    _record("h", x)

@pytest.mark.parametrize("x", [random.Random().randrange(10**9)])  # drawn at collection
def test_p(x):
    _record("p", x)

def test_profile():
    _record("derandomize", settings().derandomize)

@pytest.mark.hypothesis
@pytest.mark.timeout(3)
def test_timeout(request):
    _record("timeout", request.node.get_closest_marker("timeout").args[0])

def test_fails():
    assert False, "on purpose"
'''


def _start(tmp_path: pathlib.Path, *args: str, env: dict[str, str] | None = None) -> Callable[[], tuple[dict[str, list], str]]:
    """Starts the suite under pytest in `tmp_path` (a folder of its own per run: runs may overlap);
    the returned function waits for it and gives its draws by test name and its output."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    suite = tmp_path / "test_suite.py"
    suite.write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:kmock -p no:cacheprovider\n")
    out = tmp_path / "draws.jsonl"
    out.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k != SEED_ENV}
    run_env.update(PYTHONPATH=str(SUPPORT), DRAWS_OUT=str(out), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "pdtest.seeding", str(suite), *args],
                            cwd=tmp_path, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result() -> tuple[dict[str, list], str]:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()  # a no-op once it has exited
        assert proc.returncode in (0, 1), stdout + stderr
        draws: dict[str, list] = {}
        for line in (out.read_text() if out.exists() else "").splitlines():
            name, value = json.loads(line)
            draws.setdefault(name, []).append(value)
        return draws, stdout
    return result


@pytest.mark.slow
def test_the_same_seed_replays_the_same_draws(tmp_path):
    # Four runs of the suite, started together (each pytest takes seconds to start; CI's second core
    # would otherwise idle): seed 11 under "fuzz"; the same seed through the environment, without
    # test_a before test_b; seed 12; seed 11 under "ci".
    runs = [_start(tmp_path / "fuzz", "--seed", "11", "--hypothesis-profile", "fuzz"),
            _start(tmp_path / "again", "--hypothesis-profile", "fuzz", "-k", "test_b or test_h", env={SEED_ENV: "11"}),
            _start(tmp_path / "other", "--seed", "12", "--hypothesis-profile", "fuzz", "-k", "test_b or test_h or test_p"),
            _start(tmp_path / "ci", "--seed", "11", "-k", "test_a or test_h or test_p or test_profile or test_timeout")]
    (fuzz, output), (again, _), (other, _), (ci, _) = [run() for run in runs]
    assert output.splitlines()[0].startswith("random seed: 11 "), output  # first, even under -q
    assert "replay: pytest --seed 11 --hypothesis-profile fuzz 'test_suite.py::test_fails'" in output, output
    assert output.count("random seed: 11 (") == 2, output  # and again at the end of a failed run
    a, b = fuzz["a"][0], fuzz["b"][0]
    assert a != b and a[1] != a[2], "tests, and two unseeded Random()s, draw apart"
    assert len(fuzz["h"]) == 5 * FUZZ_FACTOR
    assert fuzz["timeout"] == [3 * FUZZ_FACTOR], "more examples, as much more time"
    # The same seed through the environment, without test_a before test_b: the same draws, since
    # a test's seed depends on (run seed, node id) only.
    assert again == {"b": fuzz["b"], "h": fuzz["h"]}
    assert other["p"] != fuzz["p"]
    assert all(x != y for x, y in zip(other["b"][0], b)), (other["b"], b)
    assert other["h"] != fuzz["h"], "fuzz draws fresh examples from another seed"
    assert ci["timeout"] == [3]
    assert (ci["a"], ci["p"]) == (fuzz["a"], fuzz["p"]), "the profile changes hypothesis only"
    assert len(ci["h"]) == 5 and ci["derandomize"] == [True], "ci: the test's own examples, not the seed's"


def test_a_tests_draws_do_not_depend_on_which_test_set_up_its_fixtures(tmp_path):
    """A module fixture is set up by the first test that uses it, inside that test's seeding; the
    test's own draws start afresh after its set-up, so test_m2 draws the same with test_m1 before
    it (which set the fixture up) and alone (where it sets it up). Before, the two differed: run
    2114677491's chat logprob test drew other prompts alone than in its module, and its failure
    passed as a flake on replay."""
    runs = [_start(tmp_path / "both", "--seed", "11", "-k", "test_m1 or test_m2"),
            _start(tmp_path / "alone", "--seed", "11", "-k", "test_m2")]
    (both, _), (alone, _) = [run() for run in runs]
    assert alone["m2"] == both["m2"]
    assert both["m1"] != both["m2"]
