"""Only `deepseek_pd/env.py` reads the environment (STYLE.md: one typed module for environment
variables). Checked on the source with `ast`, like test_import_graph.py, over every module the
package installs: an `os.environ` or `os.getenv` anywhere else fails, with its file and line."""
from __future__ import annotations

import ast

from test_import_graph import REPO, package_modules

ENV_MODULE = "deepseek_pd.env"


def _environment_uses(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "getenvb")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv", "environb", "getenvb") for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_env_module_reads_the_environment() -> None:
    found = [f"{path.relative_to(REPO)}:{line}" for module, path in package_modules().items() if module != ENV_MODULE
             for line in _environment_uses(ast.parse(path.read_text(), str(path)))]
    assert not found, f"read the environment through deepseek_pd/env.py instead: {found}"


def test_the_check_sees_each_form() -> None:
    for source in ("import os\nos.environ.get('X')", "import os\nx = os.environ['X']", "import os\nos.getenv('X')",
                   "from os import environ", "from os import getenv as g"):
        assert _environment_uses(ast.parse(source)), source
    assert not _environment_uses(ast.parse("import os\nos.path.join('a')\ns = 'os.environ'"))
