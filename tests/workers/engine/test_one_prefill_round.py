"""One prefill round for every engine (issue 24): the prefill worker, decode (colocated prompts) and
the offline engine all run prompts through `workers/engine/prefill_round.py` `PrefillRounds`, so
none of them writes a round of its own again.

Checked on the source with `ast`, as tests/test_import_graph.py checks the layers: in the package,
only `workers/engine/extend_step.py` calls a runner's `extend`/`extend_hidden` (a prompt's forward;
the speculative verify in model/ is a decode step), only `prefill_round.py` imports `extend_step`
or plans a round (`plan_extend_batch`), and each of the three engines builds a `PrefillRounds`."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_import_graph import REPO, ROOT_PACKAGE, import_edges, package_modules

_E = f"{ROOT_PACKAGE}.workers.engine"
EXTEND_CALLS = ("extend", "extend_hidden")
ENGINES = (f"{ROOT_PACKAGE}.workers.prefill.engine", f"{ROOT_PACKAGE}.workers.decode.engine", f"{_E}.offline")


def _receiver_is_a_runner(node: ast.expr) -> bool:
    """`runner.x(...)`, `self.runner.x(...)`, `anything.runner.x(...)`."""
    return (isinstance(node, ast.Name) and node.id == "runner") or (
        isinstance(node, ast.Attribute) and node.attr == "runner")


def runner_extend_calls(path: Path) -> list[int]:
    """Lines of `path` that call a runner's extend forward."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in EXTEND_CALLS and _receiver_is_a_runner(node.func.value)]


def calls_named(path: Path, name: str) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


def test_only_extend_step_runs_an_extend_forward():
    modules = package_modules()
    workers = {m: p for m, p in modules.items() if m.startswith(f"{ROOT_PACKAGE}.workers.")}
    found = {m: lines for m, p in workers.items() if (lines := runner_extend_calls(p))}
    assert set(found) == {f"{_E}.extend_step"}, found


def test_only_the_prefill_round_plans_and_launches_rounds():
    modules = package_modules()
    importers = {e.source for m in modules for e in import_edges(m, modules) if e.target == f"{_E}.extend_step"}
    assert importers == {f"{_E}.prefill_round"}, importers
    planners = {m for m, p in modules.items() if calls_named(p, "plan_extend_batch")}
    assert planners == {f"{_E}.prefill_round"}, planners


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_runs_its_prompts_through_the_prefill_round(engine):
    path = package_modules()[engine]
    assert calls_named(path, "PrefillRounds"), f"{path.relative_to(REPO)} builds no PrefillRounds"


def test_the_check_sees_a_round_written_again(tmp_path):
    """The finder itself: an engine calling its runner's extend directly is found."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text("def round(self, seqs):\n    return self.runner.extend(seqs)\n"
                     "def ok(items):\n    items.extend([1])\n")
    assert runner_extend_calls(rogue) == [2]
