"""scripts/relayout.py on a small made-up repository: what it moves, how it rewrites, that a second
run changes nothing, and that a file no row covers stops it before anything moves."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_relayout():
    spec = importlib.util.spec_from_file_location("relayout", REPO / "scripts" / "relayout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["relayout"] = module  # before exec: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


relayout = _load_relayout()

TABLE = {
    "model/__init__.py": "model/__init__.py",
    "model/config.py": "model/config.py",
    "model/engine.py": "workers/engine/offline.py",
    "model/sampling.py": "model/sampling/sampler.py",  # an old module whose name becomes a package
    "model/sampling_ops.py": "model/sampling/ops.py",
    "workers/__init__.py": "workers/__init__.py",
    "workers/prefill/": "workers/prefill/",
    "workers/common/__init__.py": None,
    "workers/common/api.py": "workers/engine/interface.py",
    "workers/common/kv/": "workers/transport/",
    "workers/common/round*.py": "workers/engine/",
    "tests/workers/common/kv/": "tests/workers/transport/",
}

FILES = {
    "setup.py": 'MAPPED_FOLDERS = ("model", "workers")\n',
    "model/__init__.py": "",
    "model/config.py": "SIZE = 1\n",
    "model/engine.py": "class Engine:\n    pass\n",
    "model/sampling.py": "class Sampler:\n    pass\n",
    "model/sampling_ops.py": "def top_k():\n    pass\n",
    "workers/__init__.py": "",
    "workers/common/__init__.py": "",
    "workers/common/api.py": "class GenerateRequest:\n    pass\n",
    "workers/common/kv/__init__.py": "",
    "workers/common/kv/base.py": "X = 1\n",
    "workers/prefill/__init__.py": "",
    "workers/prefill/engine.py": (
        "from deepseek_pd.workers.common import api\n"
        "from deepseek_pd.workers.common.api import GenerateRequest  # noqa: F401\n"
        "from deepseek_pd.model import config, sampling, sampling_ops as ops\n"
        "import deepseek_pd.workers.common.kv.base\n"
        "from deepseek_pd.workers.common.kv import base as kv_base\n"
        'TARGET = "deepseek_pd.model.engine.Engine"  # see model/engine.py\n'
        "\n"
        "\n"
        "def f():\n"
        "    from deepseek_pd.model.sampling import Sampler\n"
        "    return deepseek_pd.workers.common.kv.base.X, Sampler\n"),
    "tests/workers/common/kv/test_base.py": (
        'EXAMPLES = Path(__file__).resolve().parents[4] / "examples"\n'
        'OTHER = Path(__file__).resolve().parents[1]\n'),
    "Makefile": "run:\n\tpython -m deepseek_pd.workers.common.api --x\n",
    "docs/map.md": ("`workers/common/api.py` and `model/sampling.py`, the folder workers/common/kv/, "
                    "tests in tests/workers/common/kv/test_base.py; `model/engine`.\n"
                    "The package deepseek_pd.workers.common is split up.\n"),
}

EXPECTED = {
    "workers/prefill/engine.py": (
        "from deepseek_pd.workers.engine import interface as api\n"
        "from deepseek_pd.workers.engine.interface import GenerateRequest  # noqa: F401\n"
        "from deepseek_pd.model import config\n"
        "from deepseek_pd.model.sampling import sampler as sampling, ops\n"
        "import deepseek_pd.workers.transport.base\n"
        "from deepseek_pd.workers.transport import base as kv_base\n"
        'TARGET = "deepseek_pd.workers.engine.offline.Engine"  # see workers/engine/offline.py\n'
        "\n"
        "\n"
        "def f():\n"
        "    from deepseek_pd.model.sampling.sampler import Sampler\n"
        "    return deepseek_pd.workers.transport.base.X, Sampler\n"),
    "tests/workers/transport/test_base.py": (
        'EXAMPLES = Path(__file__).resolve().parents[3] / "examples"\n'
        'OTHER = Path(__file__).resolve().parents[1]\n'),
    "Makefile": "run:\n\tpython -m deepseek_pd.workers.engine.interface --x\n",
    "docs/map.md": ("`workers/engine/interface.py` and `model/sampling/sampler.py`, the folder workers/transport/, "
                    "tests in tests/workers/transport/test_base.py; `workers/engine/offline`.\n"
                    "The package deepseek_pd.workers.common is split up.\n"),
    "workers/engine/offline.py": FILES["model/engine.py"],
    "workers/engine/__init__.py": "",
    "workers/transport/__init__.py": "",
    "workers/transport/base.py": "X = 1\n",
    "model/sampling/__init__.py": "",
    "model/sampling/sampler.py": FILES["model/sampling.py"],
    "model/sampling/ops.py": FILES["model/sampling_ops.py"],
}


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "repo"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root.parent, "init", "-q", str(root))
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "seed")
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {p: (root / p).read_text() for p in relayout.tree_files(root)}


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(relayout, "MOVES", dict(TABLE))


def test_moves_and_rewrites(tmp_path, table):
    root = _repo(tmp_path, FILES)
    plan, left = relayout.apply(root)
    after = _snapshot(root)
    for rel, text in EXPECTED.items():
        assert after.get(rel) == text, rel
    gone = {"model/engine.py", "model/sampling.py", "workers/common/api.py", "workers/common/__init__.py",
            "workers/common/kv/base.py", "tests/workers/common/kv/test_base.py"}
    assert not gone & set(after)
    assert not (root / "workers" / "common").exists()
    # The moves are git renames, staged.
    status = _git(root, "status", "--porcelain")
    assert "R  model/engine.py -> workers/engine/offline.py" in status
    # A split package has no one new name: its mention is left, and reported.
    assert left == ["docs/map.md:2: The package deepseek_pd.workers.common is split up."]


def test_a_second_run_changes_nothing(tmp_path, table):
    root = _repo(tmp_path, FILES)
    relayout.apply(root)
    once = _snapshot(root)
    plan, left = relayout.apply(root)
    assert plan.moves == {}
    assert _snapshot(root) == once


def test_a_file_no_row_covers_stops_the_run(tmp_path, table):
    root = _repo(tmp_path, {**FILES, "workers/common/added_elsewhere.py": "Y = 2\n",
                            "model/also_new.py": "Z = 3\n",
                            # in a folder the table fills (the new layout already): no row needed
                            "model/sampling/added_there.py": "W = 4\n"})
    before = _snapshot(root)
    with pytest.raises(relayout.RelayoutError) as error:
        relayout.apply(root)
    assert "workers/common/added_elsewhere.py" in str(error.value)
    assert "model/also_new.py" in str(error.value)
    assert "added_there" not in str(error.value)
    assert _snapshot(root) == before
    assert _git(root, "status", "--porcelain") == ""
    assert relayout.main(["--root", str(root), "--check"]) == 1


def test_a_pattern_row_takes_files_added_later(tmp_path, table):
    root = _repo(tmp_path, {**FILES, "workers/common/round_core.py": "R = 1\n",
                            "model/uses_round.py": "from deepseek_pd.workers.common.round_core import R\n"})
    relayout.MOVES["model/uses_round.py"] = "model/uses_round.py"
    relayout.apply(root)
    assert (root / "workers/engine/round_core.py").read_text() == "R = 1\n"
    assert (root / "model/uses_round.py").read_text() == "from deepseek_pd.workers.engine.round_core import R\n"


def test_old_and_new_both_present_is_refused(tmp_path, table):
    root = _repo(tmp_path, {**FILES, "workers/engine/interface.py": "class GenerateRequest:\n    pass\n"})
    with pytest.raises(relayout.RelayoutError, match="workers/common/api.py is still there"):
        relayout.apply(root)


def test_the_table_covers_this_repository():
    """At merge time: a file someone added in a folder being re-cut fails here, naming the file."""
    relayout.make_plan(REPO, relayout.tree_files(REPO))


def test_the_table_file_reads_as_rows_and_refuses_a_bad_one():
    text = ("# a comment\n\nmodel/a.py    model/b/a.py  # why\nmodel/c.py =\nmodel/x/__init__.py -\n"
            "tests/model/test_k*.py tests/model/kernels/\ntests/model/test_c*.py =\n")
    assert relayout.load_moves(text) == {"model/a.py": "model/b/a.py", "model/c.py": "model/c.py",
                                         "model/x/__init__.py": None,
                                         "tests/model/test_k*.py": "tests/model/kernels/",
                                         "tests/model/test_c*.py": "tests/model/"}
    for bad, words in (("model/a.py\n", ":1: expected 'OLD NEW'"), ("a b c\n", ":1: expected"),
                       ("model/a.py =\nmodel/a.py -\n", ":2: model/a.py has a row already")):
        with pytest.raises(relayout.RelayoutError, match=words):
            relayout.load_moves(bad)
    assert relayout.MOVES == relayout.load_moves(relayout.MOVES_FILE.read_text())


HELPER_TABLE = {
    "tests/model/hf_oracle.py": "tests/support/pdtest/hf_oracle.py",
    "tests/model/fake_lib.py": "tests/support/pdtest/fake_lib.py",
    "tests/model/test_moe_align*.py": "tests/model/kernels/",  # narrower first: it wins
    "tests/model/test_moe*.py": "tests/model/moe/",
    "tests/model/test_engine*.py": "tests/workers/engine/",
    "tests/model/test_config*.py": "tests/model/",
}

HELPER_FILES = {
    "setup.py": 'MAPPED_FOLDERS = ("model",)\n',
    "tests/support/pdtest/__init__.py": "",
    "tests/model/hf_oracle.py": "from fake_lib import LIB\n\n\ndef oracle():\n    return LIB\n",
    "tests/model/fake_lib.py": "LIB = 1\n",
    "tests/model/test_moe_align.py": "from hf_oracle import oracle  # the reference\n",
    "tests/model/test_moe.py": ("import os, fake_lib\nimport hf_oracle as h\n\n\ndef test():\n"
                                "    from hf_oracle import oracle\n    return oracle, os, fake_lib, h\n"),
    "tests/model/test_engine.py": 'import fake_lib\nREPO = Path(__file__).resolve().parents[2]\n',
    "tests/model/test_config.py": "from fake_lib import LIB\n",
    "tests/other/test_elsewhere.py": "from hf_oracle import oracle\n",  # another folder's own helper
    "docs/tests.md": "tests/model/test_moe_align.py, tests/model/test_moe.py and tests/model/hf_oracle.py\n",
    "bench/run.sh": "TESTS=${TESTS:-tests/model/test_moe.py tests/model/test_config.py} my-tests/model/test_moe.py\n",
}

HELPER_EXPECTED = {
    "tests/support/pdtest/hf_oracle.py": "from pdtest.fake_lib import LIB\n\n\ndef oracle():\n    return LIB\n",
    "tests/model/kernels/test_moe_align.py": "from pdtest.hf_oracle import oracle  # the reference\n",
    "tests/model/moe/test_moe.py": ("import os\nfrom pdtest import fake_lib\nfrom pdtest import hf_oracle as h\n\n\n"
                                    "def test():\n    from pdtest.hf_oracle import oracle\n"
                                    "    return oracle, os, fake_lib, h\n"),
    "tests/workers/engine/test_engine.py": 'from pdtest import fake_lib\nREPO = Path(__file__).resolve().parents[3]\n',
    "tests/model/test_config.py": "from pdtest.fake_lib import LIB\n",
    "tests/other/test_elsewhere.py": "from hf_oracle import oracle\n",
    "docs/tests.md": ("tests/model/kernels/test_moe_align.py, tests/model/moe/test_moe.py and "
                      "tests/support/pdtest/hf_oracle.py\n"),
    "bench/run.sh": ("TESTS=${TESTS:-tests/model/moe/test_moe.py tests/model/test_config.py} "
                     "my-tests/model/test_moe.py\n"),
}


def test_test_files_split_by_name_and_their_helpers_move_into_pdtest(tmp_path, monkeypatch):
    """Patterns map test files by name (the first that matches wins), helpers move into
    tests/support/pdtest and every import of them by bare name under the old folder follows (the
    moved tests', the helpers' own, the ones that stay); a second run changes nothing, and a run on a
    tree that has new files since maps those that a pattern covers and refuses the rest, by name."""
    monkeypatch.setattr(relayout, "MOVES", dict(HELPER_TABLE))
    root = _repo(tmp_path, HELPER_FILES)
    relayout.apply(root)
    after = _snapshot(root)
    for rel, text in HELPER_EXPECTED.items():
        assert after.get(rel) == text, rel
    assert not {"tests/model/hf_oracle.py", "tests/model/test_moe.py"} & set(after)
    once = _snapshot(root)
    assert relayout.apply(root)[0].moves == {} and _snapshot(root) == once
    # Added on other branches meanwhile: one a pattern maps (and its bare import follows), one in a
    # new folder (no row needed), one in the old folder that no row covers.
    for rel, text in {"tests/model/test_moe_new.py": "from hf_oracle import oracle\n",
                      "tests/model/moe/test_grouped.py": "import fake_lib\n",
                      "tests/model/test_unknown.py": "X = 1\n"}.items():
        (root / rel).write_text(text)
    with pytest.raises(relayout.RelayoutError) as error:
        relayout.apply(root)
    assert "tests/model/test_unknown.py" in str(error.value) and "test_moe_new" not in str(error.value)
    (root / "tests/model/test_unknown.py").unlink()
    relayout.apply(root)
    assert (root / "tests/model/moe/test_moe_new.py").read_text() == "from pdtest.hf_oracle import oracle\n"
    assert (root / "tests/model/moe/test_grouped.py").read_text() == "from pdtest import fake_lib\n"
