"""The suite's draws stay replayable (pdtest/seeding.py): no test module draws from the OS
(`os.urandom`, `secrets`, `random.SystemRandom`, an unseeded numpy Generator), and every hypothesis
budget goes through `examples(n)`, so `make fuzz` widens it. Checked on the source with `ast`, like
test_env_module.py; a hit names its file and line."""
from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
# Credentials of the test control plane: identities, never inputs of a test (seeding.py says so).
OS_RANDOM_ALLOWED = {"k8s/pki.py", "support/pdtest/seeding.py"}
OS_DRAWS = {("os", "urandom"), ("random", "SystemRandom"), ("secrets", "token_bytes"), ("secrets", "token_hex"),
            ("secrets", "token_urlsafe"), ("secrets", "randbits"), ("secrets", "randbelow"), ("secrets", "choice")}


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else f"{_name(node.value)}.{node.attr}" \
        if isinstance(node, ast.Attribute) else ""


def unseeded_draws(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if tuple(name.rsplit(".", 1)[-2:]) in OS_DRAWS:
            lines.append(node.lineno)
        elif name.endswith("random.default_rng") and not node.args:
            lines.append(node.lineno)
        elif name.endswith("settings") and any(k.arg == "max_examples" and isinstance(k.value, ast.Constant)
                                               for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_no_test_draws_from_the_os() -> None:
    found = [f"tests/{path.relative_to(TESTS)}:{line}" for path in sorted(TESTS.rglob("*.py"))
             if str(path.relative_to(TESTS)) not in OS_RANDOM_ALLOWED
             for line in unseeded_draws(ast.parse(path.read_text(), str(path)))]
    assert not found, ("draw from the test's seed (random.randbytes, random.Random(), hypothesis' "
                       f"examples(n) for max_examples) instead: {found}")


def test_the_check_sees_each_form() -> None:
    for source in ("import os\nos.urandom(8)", "import random\nrandom.SystemRandom().random()",
                   "import secrets\nsecrets.token_bytes(32)", "import numpy as np\nnp.random.default_rng()",
                   "from hypothesis import settings\n@settings(max_examples=100)\ndef f(): pass"):
        assert unseeded_draws(ast.parse(source)), source
    for source in ("import random\nrandom.randbytes(8)", "import numpy as np\nnp.random.default_rng(3)",
                   "from hypothesis import settings\n@settings(max_examples=examples(100))\ndef f(): pass"):
        assert not unseeded_draws(ast.parse(source)), source
