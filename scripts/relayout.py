#!/usr/bin/env python3
"""The folder layout by concern (issue 24), as a codemod that can be run again on any later tree.

    python scripts/relayout.py            # apply: git mv, then rewrite every reference
    python scripts/relayout.py --check    # only say what would move, and refuse unmapped files

One table, `MOVES` (scripts/relayout_moves.txt, whose header gives its format), says where each
file or folder goes. Applying it:
1. refuses to start, listing them, when a folder being re-cut holds a file that no row covers
   (a file someone added since the table was written): add one row for it and run again;
2. `git mv`s each file that is still at its old place (a file already at its new place is skipped,
   so a second run moves nothing), and gives every new package folder an empty `__init__.py`;
3. rewrites every reference to a moved module or path in the tree's text files: `from a.b import c`
   (split when `c` itself moved elsewhere, keeping its local name with `as`), `import a.b`, dotted
   strings (importlib names, `python -m` lines, patch targets such as "deepseek_pd.x.y.Name") and
   repository paths (`workers/common/api.py`, `tests/workers/common/...`); a moved file's
   `Path(__file__).parents[N]` that named the repository root is re-counted for its new depth;
4. prints the references it could not rewrite (a bare mention of a re-cut folder, say), for a hand.

Module names come from setup.py's MAPPED_FOLDERS: `model/x.py` is `deepseek_pd.model.x`. Where an
old module's name is also the name of a new package (model/sampling.py -> model/sampling/), the name
is rewritten only in the run that moves that file: afterwards the name means the package.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

MOVES_FILE = Path(__file__).with_name("relayout_moves.txt")


def load_moves(text: str, source: str = "relayout_moves.txt") -> dict[str, str | None]:
    """The table's rows, old -> new (None: delete), in the file's order; its header says the format.
    A malformed or repeated row is a RelayoutError naming its line."""
    moves: dict[str, str | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise RelayoutError(f"{source}:{number}: expected 'OLD NEW', got {line.strip()!r}")
        old, new = fields
        if old in moves:
            raise RelayoutError(f"{source}:{number}: {old} has a row already")
        if new == "=":  # stays: a pattern's files stay in their folder
            new = str(PurePosixPath(old).parent) + "/" if "*" in old else old
        moves[old] = None if new == "-" else new
    return moves



# Files that hold old paths on purpose (the table, and its test's fixtures) are never rewritten.
NOT_REWRITTEN = ("scripts/relayout.py", "scripts/relayout_moves.txt", "tests/scripts/test_relayout.py")
# Text files whose references are rewritten, besides every .py file.
TEXT_NAMES = ("Makefile", "Dockerfile*", "*.md", "*.toml", "*.cfg", "*.ini", "*.txt", "*.sh", "*.yaml", "*.yml",
              "*.json", "*.tpl", "*.proto", "*.pyi", "*.j2")
PACKAGE = "deepseek_pd"
SUPPORT = "tests/support/"  # pyproject's pytest pythonpath: the tests' shared helpers import from here


class RelayoutError(Exception):
    """The table and the tree disagree; nothing was changed."""


# old -> new, from MOVES_FILE (tests swap in their own table).
MOVES: dict[str, str | None] = load_moves(MOVES_FILE.read_text())


@dataclass
class Plan:
    """What one run does: the moves still to make, and the name and path maps for the rewrite."""
    moves: dict[str, str | None] = field(default_factory=dict)  # old file -> new file (None: delete)
    modules: dict[str, str] = field(default_factory=dict)  # old dotted (module or package) -> new
    paths: dict[str, str] = field(default_factory=dict)  # old repo path (file stem or folder) -> new
    folder_paths: set[str] = field(default_factory=set)  # the keys of `paths` that are folders
    gone: set[str] = field(default_factory=set)  # old dotted packages that no longer exist
    gone_paths: set[str] = field(default_factory=set)  # old folders that no longer exist
    ambiguous: set[str] = field(default_factory=set)  # old dotted names that are new packages too
    ambiguous_paths: set[str] = field(default_factory=set)  # old path stems that are new folders too
    depth_change: dict[str, tuple[int, int]] = field(default_factory=dict)  # new file -> (old, new depth)
    bare: dict[str, str] = field(default_factory=dict)  # a test helper's bare module name -> its name in SUPPORT
    bare_scope: set[str] = field(default_factory=set)  # folders whose files import those helpers bare
    bare_files: set[str] = field(default_factory=set)  # the new places of files moved out of those folders

    def imports_bare(self, path: str) -> bool:
        """Whether `path` may import a moved test helper by its bare name."""
        return path in self.bare_files or any(path.startswith(folder) for folder in self.bare_scope)


def tree_files(root: Path) -> list[str]:
    """Tracked files and untracked ones git does not ignore, as repo-relative posix paths."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted(p for p in set(out.split("\0")) if p and (root / p).is_file())


def mapped_folders(root: Path) -> tuple[str, ...]:
    """setup.py's MAPPED_FOLDERS (read, not run): top-level folders installed as deepseek_pd.<folder>."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAPPED_FOLDERS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RelayoutError("setup.py has no MAPPED_FOLDERS")


def dotted(path: str, folders: tuple[str, ...]) -> str | None:
    """The import name of a repo path (a .py file or a folder), or None when it is not in the package."""
    parts = list(PurePosixPath(path.rstrip("/")).parts)
    if not parts or (parts[0] not in folders and parts[0] != PACKAGE):
        return None
    if parts[-1].endswith(".py"):
        parts[-1] = parts[-1][:-3]
        if parts[-1] == "__init__":
            parts.pop()
    elif "." in parts[-1]:
        return None
    if any(not p.isidentifier() for p in parts):
        return None
    return ".".join(parts if parts[0] == PACKAGE else [PACKAGE, *parts])


def _rows() -> list[tuple[str, str | None, str]]:
    """MOVES as (old, new, kind), kind one of file, folder, glob; a malformed row is refused."""
    rows = []
    for old, new in MOVES.items():
        if "*" in old:
            if new is None or not new.endswith("/"):
                raise RelayoutError(f"pattern row {old!r} must map into a folder ending in '/'")
            rows.append((old, new, "glob"))
        elif old.endswith("/"):
            if new is None or not new.endswith("/"):
                raise RelayoutError(f"folder row {old!r} must map to a folder ending in '/'")
            rows.append((old, new, "folder"))
        else:
            if new is not None and new.endswith("/"):
                new = new + PurePosixPath(old).name
            rows.append((old, new, "file"))
    return rows


def _destination(path: str, rows) -> tuple[bool, str | None] | None:
    """Where the row that covers `path` (as an old path) sends it: exact, then pattern, then the
    longest folder; None when no row covers it."""
    for old, new, kind in rows:
        if kind == "file" and old == path:
            return True, new
    for old, new, kind in rows:
        if kind == "glob" and PurePosixPath(path).parent == PurePosixPath(old).parent \
                and fnmatch.fnmatch(PurePosixPath(path).name, PurePosixPath(old).name):
            return True, new + PurePosixPath(path).name
    folders = [(old, new) for old, new, kind in rows if kind == "folder" and path.startswith(old)]
    if folders:
        old, new = max(folders, key=lambda r: len(r[0]))
        return True, new + path[len(old):]
    return None


def _is_new_side(path: str, rows) -> bool:
    """Whether `path` is where some row puts a file, or the package marker the run gives a new
    folder (so that a second run finds it covered)."""
    if PurePosixPath(path).name == "__init__.py":
        folder = PurePosixPath(path).parent
        if any(new is not None and folder in PurePosixPath(new.rstrip("/") + ("/x" if new.endswith("/") else "")).parents
               for _, new, _ in rows):
            return True
    for old, new, kind in rows:
        if kind == "file" and new == path:
            return True
        if kind == "folder" and path.startswith(new):
            return True
        if kind == "glob" and PurePosixPath(path).parent == PurePosixPath(new) \
                and fnmatch.fnmatch(PurePosixPath(path).name, PurePosixPath(old).name):
            return True
    return False


def recut_folders(rows) -> set[str]:
    """Folders from which single files move: each of their files (at any depth) needs a row."""
    return {str(PurePosixPath(old).parent) + "/" for old, _, kind in rows if kind in ("file", "glob")}


def settled_folders(rows) -> set[str]:
    """The new folders rows fill that are not re-cut themselves (model/quant/, tests/model/moe/):
    a file added there since is already in the new layout, and needs no row."""
    folders = {new if kind != "file" else str(PurePosixPath(new).parent) + "/"
               for _, new, kind in rows if new is not None}
    return folders - recut_folders(rows)


def unmapped(files: list[str], rows) -> list[str]:
    cut, settled = recut_folders(rows), settled_folders(rows)
    return [f for f in files if any(f.startswith(c) for c in cut) and not any(f.startswith(s) for s in settled)
            and _destination(f, rows) is None and not _is_new_side(f, rows)]


def _support_names(old: str, new: str) -> tuple[str, str] | None:
    """(bare name, new dotted name) of a test helper that moves into SUPPORT, else None. A test
    folder without `__init__.py` is on sys.path for the tests in it (pytest's prepend import mode),
    so they import `tests/model/hf_oracle.py` as `hf_oracle`; in SUPPORT (pyproject's pythonpath)
    it is `pdtest.hf_oracle`."""
    if (old.startswith("tests/") and not old.startswith(SUPPORT) and new.startswith(SUPPORT)
            and old.endswith(".py") and new.endswith(".py")):
        return PurePosixPath(old).stem, new[len(SUPPORT):-3].replace("/", ".")
    return None


def _depth(path: str) -> int:
    return len(PurePosixPath(path).parts) - 1


def make_plan(root: Path, files: list[str]) -> Plan:
    rows = _rows()
    missing = unmapped(files, rows)
    if missing:
        raise RelayoutError("these files sit in a folder that is being re-cut, and no row of "
                            "scripts/relayout_moves.txt says where they go (add one row each, or a pattern "
                            "that covers them, then run again):\n  "
                            + "\n  ".join(missing))
    folders = mapped_folders(root)
    present = set(files)
    plan = Plan()
    # The moves still to make, and the names of every file a row covers, moved now or before.
    for path in files:
        dest = _destination(path, rows)
        if dest is None or dest[1] == path:
            continue
        new = dest[1]
        if new is not None and new in present:
            raise RelayoutError(f"{path} is still there and its new place {new} exists too: "
                                "which one is meant? (remove one, then run again)")
        plan.moves[path] = new
        if new is not None:
            plan.depth_change[new] = (_depth(path), _depth(new))
    # The name and path maps come from the rows, not from what is moved now, so that a reference
    # written in old names after an earlier run is still rewritten.
    covered_old: dict[str, str | None] = {}
    for old, new, kind in sorted(rows, key=lambda r: r[2] == "file"):  # file rows last: they win
        if kind == "file":
            covered_old[old] = new
        elif kind == "glob":
            for path in files:
                # setdefault: the first pattern that matches wins, as in `_destination`
                if fnmatch.fnmatch(path, old) and PurePosixPath(path).parent == PurePosixPath(old).parent:
                    covered_old.setdefault(path, new + PurePosixPath(path).name)
                elif PurePosixPath(path).parent == PurePosixPath(new) \
                        and fnmatch.fnmatch(PurePosixPath(path).name, PurePosixPath(old).name):
                    covered_old.setdefault(str(PurePosixPath(old).parent / PurePosixPath(path).name), path)
        elif old != new:
            src, dst = dotted(old, folders), dotted(new, folders)
            if src and dst:
                plan.modules[src] = dst
            plan.paths[old.rstrip("/")] = new.rstrip("/")
            plan.folder_paths.add(old.rstrip("/"))
    for old, new in covered_old.items():
        if new == old:
            continue
        src = dotted(old, folders) if old.endswith(".py") else None
        if new is None:
            if src and old.endswith("/__init__.py"):
                plan.gone.add(src)
                plan.gone_paths.add(str(PurePosixPath(old).parent))
            continue
        if src:
            dst = dotted(new, folders)
            if dst:
                plan.modules[src] = dst
        stem_old, stem_new = (old[:-3], new[:-3]) if old.endswith(".py") and new.endswith(".py") else (old, new)
        plan.paths[stem_old] = stem_new
    for old, new in covered_old.items():
        if new is not None and (names := _support_names(old, new)) is not None:
            plan.bare[names[0]] = names[1]
            plan.bare_scope.add(str(PurePosixPath(old).parent) + "/")
    plan.bare_files = {new for old, new in covered_old.items()
                       if new is not None and any(old.startswith(folder) for folder in plan.bare_scope)}
    new_names = set(plan.modules.values())
    for src in plan.modules:
        if any(n.startswith(src + ".") for n in new_names):
            plan.ambiguous.add(src)
    # An ambiguous name or path is rewritten only in the run that moves its file.
    moving = {dotted(p, folders) for p in plan.moves}
    for src in plan.ambiguous - moving:
        plan.modules.pop(src)
    moving_paths = {p[:-3] if p.endswith(".py") else p for p in plan.moves}
    new_paths = set(plan.paths.values())
    plan.ambiguous_paths = {s for s in plan.paths if any(n.startswith(s + "/") for n in new_paths)}
    for stem in plan.ambiguous_paths - moving_paths:
        plan.paths.pop(stem)
    return plan


# --------------------------------------------------------------------------- the rewrite


def map_dotted(name: str, plan: Plan) -> str:
    """`name` with its longest moved prefix (whole components) replaced."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        head = ".".join(parts[:cut])
        if head in plan.modules:
            return ".".join([plan.modules[head], *parts[cut:]])
    return name


_DOTTED = re.compile(r"(?<![\w.])" + PACKAGE + r"(?:\.\w+)+")


def rewrite_dotted(text: str, plan: Plan) -> str:
    return _DOTTED.sub(lambda m: map_dotted(m.group(0), plan), text)


def _path_regex(plan: Plan) -> re.Pattern | None:
    if not plan.paths:
        return None
    alts = []
    for old in sorted(plan.paths, key=len, reverse=True):
        tail = r"(?![\w-])" if old in plan.folder_paths else r"(?![\w/-])"
        alts.append(re.escape(old) + tail)
    # Not inside a longer name (x.tests/..., my-tests/...), but after a shell default's ":-".
    return re.compile(r"(?<![\w.])(?<![\w.]-)(?:" + "|".join(alts) + ")")


def rewrite_paths(text: str, plan: Plan, regex: re.Pattern | None) -> str:
    if regex is None:
        return text
    return regex.sub(lambda m: plan.paths[m.group(0)], text)


def _lines(text: str) -> list[str]:
    """The lines as ast counts them (split at newlines only, not at form feeds), ends kept."""
    return [line + "\n" for line in text.split("\n")]


def _offsets(text: str) -> list[int]:
    starts, pos = [0], 0
    for line in _lines(text):
        pos += len(line)
        starts.append(pos)
    return starts


def _chars(line: str, byte_offset: int) -> int:
    """ast's columns count UTF-8 bytes; the text is indexed by characters."""
    return len(line.encode()[:byte_offset].decode(errors="ignore"))


def _render_from(indent: str, base: str, names: list[str], comment: str) -> str:
    line = f"from {base} import {', '.join(names)}"
    if len(indent) + len(line) + len(comment) > 110 and len(names) > 1:
        body = "".join(f"{indent}    {n},\n" for n in names)
        return f"from {base} import ({comment}\n{body}{indent})"
    return line + comment


def _rewrite_import_from(node: ast.ImportFrom, text: str, start: int, end: int, plan: Plan) -> str | None:
    """The new text of one `from X import ...` statement, or None when it stays as it is."""
    base = node.module or ""
    new_base = map_dotted(base, plan)
    groups: dict[str, list[str]] = {}
    changed = new_base != base
    for alias in node.names:
        local = alias.asname or alias.name
        new_full = map_dotted(f"{base}.{alias.name}", plan) if alias.name != "*" else f"{new_base}.*"
        target_base, leaf = new_full.rpartition(".")[::2]
        if (target_base, leaf) != (new_base, alias.name):
            changed = True
        entry = leaf if leaf == local else f"{leaf} as {local}"
        groups.setdefault(target_base, []).append(entry)
    if not changed:
        return None
    original = text[start:end]
    if list(groups) == [new_base] and all(
            (a.asname is None and e == a.name) or e == f"{a.name} as {a.asname}"
            for a, e in zip(node.names, groups[new_base])):
        return original.replace(base, new_base, 1)
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    joiner = "\n" + indent if indent.strip() == "" else "; "
    comments = [c.strip() for c in re.findall(r"#[^\n]*", original)]
    comment = ("  " + "  ".join(comments)) if comments else ""
    statements = [_render_from(indent if joiner != "; " else "", b, names, comment if i == 0 else "")
                  for i, (b, names) in enumerate(groups.items())]
    return joiner.join(statements)


_PARENTS = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)(\])")


def _rewrite_bare_import(node: ast.Import | ast.ImportFrom, text: str, start: int, end: int,
                         bare: dict[str, str]) -> str | None:
    """A statement that imports a moved test helper by its bare name, importing it by its new one:
    `from hf_oracle import X` -> `from pdtest.hf_oracle import X`, `import fake_deep_ep` ->
    `from pdtest import fake_deep_ep` (the same local name); None when it names none."""
    original = text[start:end]
    if isinstance(node, ast.ImportFrom):
        head, dot, rest = (node.module or "").partition(".")
        if node.level or head not in bare:
            return None
        return re.sub(r"\bfrom\s+" + re.escape(node.module), "from " + bare[head] + dot + rest, original, count=1)
    if not any(alias.name in bare for alias in node.names):
        return None
    statements = []
    for alias in node.names:
        local = f" as {alias.asname}" if alias.asname else ""
        if alias.name in bare:
            package, _, leaf = bare[alias.name].rpartition(".")
            statements.append(f"from {package} import {leaf}{local if alias.asname != leaf else ''}" if package
                              else f"import {leaf}{local}")
        else:
            statements.append(f"import {alias.name}{local}")
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    comments = re.findall(r"#[^\n]*", original)
    statements[0] += ("  " + "  ".join(c.strip() for c in comments)) if comments else ""
    return ("\n" + indent if indent.strip() == "" else "; ").join(statements)


def rewrite_python(text: str, plan: Plan, regex: re.Pattern | None, depth: tuple[int, int] | None,
                   bare: dict[str, str] | None = None) -> str:
    """Import statements through the syntax tree; every other dotted name and path as text.
    `bare`: the moved test helpers this file may import by their bare names."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return rewrite_paths(rewrite_dotted(text, plan), plan, regex)
    starts = _offsets(text)
    lines = _lines(text)
    edits = []
    for node in ast.walk(tree):
        ours = isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE
        if not ours and not (bare and isinstance(node, (ast.Import, ast.ImportFrom))):
            continue
        s = starts[node.lineno - 1] + _chars(lines[node.lineno - 1], node.col_offset)
        e = starts[node.end_lineno - 1] + _chars(lines[node.end_lineno - 1], node.end_col_offset)
        # A trailing comment on the statement's last line goes with it.
        line_end = text.find("\n", e)
        line_end = len(text) if line_end < 0 else line_end
        rest = text[e:line_end]
        if rest.strip().startswith("#"):
            e = line_end
        edits.append((s, e, node, ours))
    out, pos = [], 0
    for s, e, node, ours in sorted(edits, key=lambda x: x[0]):
        out.append(rewrite_paths(rewrite_dotted(text[pos:s], plan), plan, regex))
        new = _rewrite_import_from(node, text, s, e, plan) if ours else _rewrite_bare_import(node, text, s, e, bare)
        out.append(text[s:e] if new is None else new)
        pos = e
    out.append(rewrite_paths(rewrite_dotted(text[pos:], plan), plan, regex))
    result = "".join(out)
    if depth is not None and depth[0] != depth[1]:
        old_depth, new_depth = depth
        result = _PARENTS.sub(lambda m: m.group(1) + (str(new_depth) if int(m.group(2)) == old_depth
                                                      else m.group(2)) + m.group(3), result)
    return result


def is_text_target(path: str) -> bool:
    name = PurePosixPath(path).name
    return path not in NOT_REWRITTEN and (name.endswith(".py") or any(fnmatch.fnmatch(name, p) for p in TEXT_NAMES))


def leftovers(root: Path, files: list[str], plan: Plan) -> list[str]:
    """Mentions of an old module or folder that the rewrite could not turn into a new one."""
    names = sorted((set(plan.modules) - plan.ambiguous) | plan.gone, key=len, reverse=True)
    folders = sorted(plan.gone_paths, key=len, reverse=True)
    if not names and not folders:
        return []
    pattern = re.compile("|".join([r"(?<![\w.])" + re.escape(n) + r"(?![\w])" for n in names]
                                  + [r"(?<![\w.-])" + re.escape(f) + r"(?![\w-])" for f in folders]))
    found = []
    for path in files:
        if not is_text_target(path):
            continue
        try:
            text = (root / path).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path}:{number}: {line.strip()[:140]}")
    return found


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def apply(root: Path, check_only: bool = False) -> tuple[Plan, list[str]]:
    """Run the codemod on the repository at `root`; returns the plan and the leftover mentions."""
    files = tree_files(root)
    plan = make_plan(root, files)
    if check_only:
        return plan, []
    folders = mapped_folders(root)
    for old, new in sorted(plan.moves.items()):
        if new is None:
            _git(root, "rm", "-q", "--cached", "--ignore-unmatch", old)
            (root / old).unlink(missing_ok=True)
            continue
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", old], cwd=root, capture_output=True).returncode == 0
        if tracked:
            _git(root, "mv", old, new)
        else:
            (root / old).rename(root / new)
    # Every new folder of the package is a package.
    for new in sorted(n for n in plan.moves.values() if n):
        folder = PurePosixPath(new).parent
        while dotted(str(folder), folders) and str(folder) not in folders:
            marker = root / folder / "__init__.py"
            if not marker.exists():
                marker.write_text("")
                _git(root, "add", str(folder / "__init__.py"))
            folder = folder.parent
    # Old folders left empty (only caches) go.
    for old in plan.moves:
        folder = (root / old).parent
        while folder != root and folder.exists() and not any(p for p in folder.rglob("*") if p.is_file()
                                                             and "__pycache__" not in p.parts):
            for cache in sorted(folder.rglob("*"), reverse=True):
                cache.rmdir() if cache.is_dir() else cache.unlink()
            folder.rmdir()
            folder = folder.parent
    files = tree_files(root)
    regex = _path_regex(plan)
    for path in files:
        if not is_text_target(path):
            continue
        target = root / path
        try:
            text = target.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.endswith(".py"):
            new_text = rewrite_python(text, plan, regex, plan.depth_change.get(path),
                                      plan.bare if plan.imports_bare(path) else None)
        else:
            new_text = rewrite_paths(rewrite_dotted(text, plan), plan, regex)
        if new_text != text:
            target.write_text(new_text)
    return plan, leftovers(root, files, plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository to re-lay (default: the one this script is in)")
    parser.add_argument("--check", action="store_true", help="refuse unmapped files and list the moves; change nothing")
    args = parser.parse_args(argv)
    try:
        plan, left = apply(args.root.resolve(), check_only=args.check)
    except RelayoutError as error:
        print(f"relayout: {error}", file=sys.stderr)
        return 1
    verb = "would move" if args.check else "moved"
    print(f"relayout: {verb} {sum(1 for n in plan.moves.values() if n)} file(s), "
          f"deleted {sum(1 for n in plan.moves.values() if n is None)}")
    if args.check:
        for old, new in sorted(plan.moves.items()):
            print(f"  {old} -> {new}")
    if left:
        print(f"relayout: {len(left)} mention(s) of an old name or folder left for a hand:", file=sys.stderr)
        for row in left:
            print(f"  {row}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
