"""The three engines prefill through the one prefill round (workers/engine/prefill_round.py), and no
fourth copy of it creeps back.

Statically (from the source, as tests/test_import_graph.py reads it): the prefill worker's, the
decode worker's and the offline engine's modules import it, and no other module of the package
plans a round, samples a first token over an extend, or calls the runner's extend forwards on its
own. At run time (a spy on `PrefillRounds.forward`): a PD request's prompt is computed through it
on the prefill worker, a colocated one on the decode worker and a prompt given to the offline
engine there, each chunked into the rounds the budget gives, with the oracle's tokens.
"""
from __future__ import annotations

import ast
import asyncio
import random

import pytest

from deepseek_pd.workers.engine.offline import Engine
from deepseek_pd.model.sampling.params import SamplingParams
from deepseek_pd.workers.engine.interface import GenerateRequest
from deepseek_pd.workers.engine.prefill_round import PrefillRounds
from deepseek_pd.workers.decode.engine import DecodeEngine
from pdtest.pd_engine_harness import CHUNK, PAGE_SIZE, PDPair, collect, oracle, runner, worker_config
from test_import_graph import ROOT_PACKAGE, import_edges, package_modules

pytestmark = pytest.mark.timeout(120)

CORE = f"{ROOT_PACKAGE}.workers.engine.prefill_round"
# The core's forward (one extend + first tokens, + the MTP pass), which it imports; benches time it alone.
FORWARD = f"{ROOT_PACKAGE}.workers.engine.extend_step"
ENGINES = {f"{ROOT_PACKAGE}.workers.prefill.engine", f"{ROOT_PACKAGE}.workers.decode.engine",
           f"{ROOT_PACKAGE}.workers.engine.offline"}
# The pieces of a round, and the modules that may use them: where each is defined, and the core.
ROUND_PIECES = {"plan_extend_batch": f"{ROOT_PACKAGE}.workers.engine.prefill_planner",
                "run_extend": FORWARD,
                "run_extend_with_mtp": FORWARD,
                "mtp_over_extend": f"{ROOT_PACKAGE}.model.speculative.decoder"}
# Modules below the engines that call the runner's extend forwards themselves: the runner's own
# layers, and the speculative decoder's verify forward (several draft tokens per sequence).
EXTEND_CALLERS = {FORWARD, f"{ROOT_PACKAGE}.model.speculative.decoder"}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)


def _uses(tree: ast.AST, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.alias) and node.name in names:
            found.add(node.name)
    return found


def _runner_extend_calls(tree: ast.AST) -> list[int]:
    """Lines calling `<...>runner.extend(...)` or `.extend_hidden(...)`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("extend", "extend_hidden"):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "runner":
                lines.append(node.lineno)
    return lines


def test_the_engines_import_the_round_and_nothing_else_builds_one():
    modules = package_modules()
    edges = {(e.source, e.target) for m in ENGINES for e in import_edges(m, modules)}
    assert all((engine, CORE) in edges for engine in ENGINES), f"an engine does not import {CORE}"
    strays = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for piece in sorted(_uses(tree, set(ROUND_PIECES))):
            if module not in (CORE, FORWARD, ROUND_PIECES[piece]):
                strays.append(f"{module} uses {piece}")
        if module not in EXTEND_CALLERS and not module.startswith(f"{ROOT_PACKAGE}.model.") \
                or module == f"{ROOT_PACKAGE}.workers.engine.offline":
            strays += [f"{module}:{line} calls the runner's extend" for line in _runner_extend_calls(tree)]
    assert not strays, "a prefill round outside workers/engine/prefill_round.py:\n  " + "\n  ".join(strays)


def test_the_static_check_sees_a_copy(tmp_path):
    """Guard against a vacuous pass: a module planning and running a round of its own is caught."""
    copy = ast.parse("from deepseek_pd.workers.engine.prefill_planner import plan_extend_batch\n"
                     "def round(self, queue):\n"
                     "    plan = plan_extend_batch(queue, 8)\n"
                     "    return self.runner.extend(plan.seqs)\n")
    assert _uses(copy, set(ROUND_PIECES)) == {"plan_extend_batch"}
    assert _runner_extend_calls(copy) == [4]


@pytest.fixture
def spy(monkeypatch):
    """Every forward of a round: the module of its owners' type, and its new tokens."""
    calls: list[tuple[str, int]] = []
    forward = PrefillRounds.forward

    def spied(self, plan, states, *rest):
        kinds = {type(item.owner).__module__ for item in plan.items}
        assert len(kinds) == 1
        calls.append((kinds.pop(), sum(len(seq.token_ids) for seq in plan.seqs)))
        return forward(self, plan, states, *rest)

    monkeypatch.setattr(PrefillRounds, "forward", spied)
    return calls


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(2, oracle().vocab_size) for _ in range(rng.randint(CHUNK + 1, 3 * CHUNK))]


def test_each_engine_prefills_through_the_round(spy):
    rng = random.Random()
    prompts = [_prompt(rng) for _ in range(3)]
    expected = [oracle().generate(p, GREEDY).output_ids for p in prompts]
    spy.clear()  # the oracle's own rounds (it is the offline engine too)

    offline = Engine("tiny", page_size=PAGE_SIZE, chunked_prefill_size=CHUNK)
    assert offline.generate(prompts[0], GREEDY).output_ids == expected[0]

    async def colocated():
        engine = DecodeEngine(runner(), worker_config("fake"), tokenizer=oracle().tokenizer)
        await engine.start()
        try:
            return await collect(engine, GenerateRequest("c", tuple(prompts[1]), GREEDY))
        finally:
            await engine.stop()

    assert asyncio.run(colocated()).tokens == expected[1]

    async def pd():
        async with PDPair("fake") as pair:
            return await pair.run(prompts[2], GREEDY, "pd")

    prefill, decode = asyncio.run(pd())
    assert prefill.ok and decode.tokens == expected[2]
    rounds = {}
    for kind, tokens in spy:
        assert tokens <= CHUNK
        rounds.setdefault(kind, []).append(tokens)
    assert list(rounds) == [f"{ROOT_PACKAGE}.workers.engine.offline", f"{ROOT_PACKAGE}.workers.decode.request_state",
                            f"{ROOT_PACKAGE}.workers.prefill.engine"]
    # Each prompt went through the round whole, chunked by the budget (the prefill side may hit nothing cached).
    assert [sum(r) for r in rounds.values()] == [len(p) for p in prompts]
    assert [len(r) for r in rounds.values()] == [-(-len(p) // CHUNK) for p in prompts]
