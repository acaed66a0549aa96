#!/usr/bin/env python3
"""The folder layout by concern (issue 24), as a codemod that can be run again on any later tree.

    python scripts/relayout.py            # apply: git mv, then rewrite every reference
    python scripts/relayout.py --check    # only say what would move, and refuse unmapped files

One table, `MOVES`, says where each file or folder goes. Applying it:
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

# old -> new. A folder ends with "/" and moves whole (its files keep their names and subfolders);
# a pattern with "*" maps each file it matches into the folder it names; None deletes the file
# (the package marker of a folder that is split up). A row whose new equals its old keeps a file or
# folder in place inside a folder being re-cut (so that it counts as covered).
MOVES: dict[str, str | None] = {
    # --- workers/: the two roles stay; the shared code is cut by concern ---------------------
    "workers/__init__.py": "workers/__init__.py",
    "workers/prefill/": "workers/prefill/",
    "workers/decode/": "workers/decode/",
    "workers/common/__init__.py": None,
    # engine/: the shared engine core (knows no role): the request's life, the model thread, the
    # prefill round and its planner, the offline engine
    "workers/common/api.py": "workers/engine/interface.py",
    "workers/common/extend_step.py": "workers/engine/extend_step.py",
    "workers/common/model_thread.py": "workers/engine/model_thread.py",
    "workers/common/request_failure.py": "workers/engine/request_failure.py",
    "workers/common/request_lifecycle.py": "workers/engine/request_lifecycle.py",
    "workers/common/request_watch.py": "workers/engine/request_watch.py",
    "workers/common/worker_config.py": "workers/engine/worker_config.py",
    "workers/common/prefill_round*.py": "workers/engine/",
    "model/engine.py": "workers/engine/offline.py",
    "model/prefill_planner.py": "workers/engine/prefill_planner.py",
    "model/request_rules.py": "workers/engine/request_rules.py",
    # transport/: the PD handoff both roles share: the bootstrap protocol, its auth, KV transports
    "workers/common/kv_transfer/": "workers/transport/",
    "workers/common/bootstrap_protocol.py": "workers/transport/bootstrap_protocol.py",
    "workers/common/bootstrap_routes.py": "workers/transport/bootstrap_routes.py",
    "workers/common/first_token_wire.py": "workers/transport/first_token_wire.py",
    "workers/common/internal_auth.py": "workers/transport/internal_auth.py",
    # group/: a worker that is a group of ranks
    "workers/common/group_front.py": "workers/group/front.py",
    "workers/common/group_layout.py": "workers/group/layout.py",
    "workers/common/rank_group.py": "workers/group/rank_group.py",
    "workers/common/lockstep.py": "workers/group/lockstep.py",
    "workers/common/remote_engine.py": "workers/group/remote_engine.py",
    # api/: the gRPC front the router talks to
    "workers/common/servicer.py": "workers/api/servicer.py",
    "workers/common/server.py": "workers/api/server.py",
    "workers/common/proto_convert.py": "workers/api/proto_convert.py",
    "workers/common/validation.py": "workers/api/validation.py",
    "workers/common/served_model.py": "workers/api/served_model.py",
    "workers/common/tokenizer_bundle.py": "workers/api/tokenizer_bundle.py",
    "workers/common/text_pieces.py": "workers/api/text_pieces.py",
    # metrics/: what a worker process measures and serves on /metrics
    "workers/common/metrics.py": "workers/metrics/worker_metrics.py",
    "workers/common/metrics_server.py": "workers/metrics/server.py",
    "workers/common/bulk_histogram.py": "workers/metrics/bulk_histogram.py",
    "workers/common/gc_pauses.py": "workers/metrics/gc_pauses.py",
    # serve/: `deepseek-pd serve`: the flag contract, its resolution, the per-role builders, mains
    "workers/serve_flags.py": "workers/serve/flags.py",
    "workers/serve_resolution.py": "workers/serve/resolution.py",
    "workers/common/serve_config.py": "workers/serve/config.py",
    "workers/roles.py": "workers/serve/roles.py",
    "workers/builders.py": "workers/serve/builders.py",
    "workers/engine_options.py": "workers/serve/engine_options.py",
    "workers/common/engine_factory.py": "workers/serve/engine_factory.py",
    "workers/common/worker_main.py": "workers/serve/worker_main.py",
    "workers/group_main.py": "workers/serve/group_main.py",
    # --- model/: the model and what runs it, by concern --------------------------------------
    "model/__init__.py": "model/__init__.py",
    "model/attention/": "model/attention/",
    "model/kernels/": "model/kernels/",
    "model/eplb/": "model/eplb/",
    "model/moe/": "model/moe/",
    # the model itself and the runner stay at the top
    "model/build_options.py": "model/build_options.py",
    "model/config.py": "model/config.py",
    "model/cuda_graph.py": "model/cuda_graph.py",
    "model/decoder_layer.py": "model/decoder_layer.py",
    "model/deepseek.py": "model/deepseek.py",
    "model/device.py": "model/device.py",
    "model/forward_batch.py": "model/forward_batch.py",
    "model/graph_inputs.py": "model/graph_inputs.py",
    "model/host_copy.py": "model/host_copy.py",
    "model/layer_ops.py": "model/layer_ops.py",
    "model/norm.py": "model/norm.py",
    "model/norm_rope.py": "model/norm_rope.py",
    "model/nvml.py": "model/nvml.py",
    "model/registry.py": "model/registry.py",
    "model/rope.py": "model/rope.py",
    "model/runner.py": "model/runner.py",
    "model/batch_invariant.py": "model/batch_invariant.py",
    # quant/: FP8 weights, their linear layer, loading and the torch reference
    "model/fp8.py": "model/quant/fp8.py",
    "model/fp8_linear.py": "model/quant/fp8_linear.py",
    "model/fp8_loading.py": "model/quant/fp8_loading.py",
    "model/fp8_ops.py": "model/quant/fp8_ops.py",
    # sampling/: per-request parameters, the batched sampler, its state and host results, stops
    "model/sampling.py": "model/sampling/sampler.py",
    "model/sampling_batch.py": "model/sampling/batch.py",
    "model/sampling_noise.py": "model/sampling/noise.py",
    "model/sampling_ops.py": "model/sampling/ops.py",
    "model/sampling_params.py": "model/sampling/params.py",
    "model/sampling_state.py": "model/sampling/state.py",
    "model/sampled_host.py": "model/sampling/sampled_host.py",
    "model/stop_checker.py": "model/sampling/stop_checker.py",
    # speculative/: MTP drafting and its acceptance
    "model/speculative.py": "model/speculative/decoder.py",
    "model/speculative_rules.py": "model/speculative/rules.py",
    "model/speculative_sampling.py": "model/speculative/acceptance.py",
    "model/speculation_policy.py": "model/speculative/policy.py",
    "model/mtp.py": "model/speculative/mtp.py",
    "model/mtp_names.py": "model/speculative/mtp_names.py",
    # kv/: the paged KV pool, its sizing and the memory budget it is cut from
    "model/kv_pool.py": "model/kv/pool.py",
    "model/kv_pool_sizing.py": "model/kv/pool_sizing.py",
    "model/layer_progress.py": "model/kv/layer_progress.py",
    "model/memory_budget.py": "model/kv/memory_budget.py",
    "model/memory_headroom.py": "model/kv/memory_headroom.py",
    # distributed/: ranks and their groups, how rows and tokens move between them, two-batch overlap
    "model/parallel.py": "model/distributed/parallel.py",
    "model/dispatch_mode.py": "model/distributed/dispatch_mode.py",
    "model/scatter_mode.py": "model/distributed/scatter_mode.py",
    "model/layer_communicator.py": "model/distributed/layer_communicator.py",
    "model/step_sync.py": "model/distributed/step_sync.py",
    "model/tp_replay.py": "model/distributed/tp_replay.py",
    "model/tbo.py": "model/distributed/tbo.py",
    "model/tbo_rules.py": "model/distributed/tbo_rules.py",
    # checkpoint/: reading HF checkpoints into our parameters, and the embedded tiny one
    "model/loader.py": "model/checkpoint/loader.py",
    "model/weight_mapping.py": "model/checkpoint/weight_mapping.py",
    "model/model_dir.py": "model/checkpoint/model_dir.py",
    "model/tiny.py": "model/checkpoint/tiny.py",
    "model/tokenizer_builder.py": "model/checkpoint/tokenizer_builder.py",
    # --- tests/workers/common/ follows its sources -------------------------------------------
    "tests/workers/common/kv_transfer/": "tests/workers/transport/",
    "tests/workers/common/test_bulk_histogram.py": "tests/workers/metrics/",
    "tests/workers/common/test_gc_pauses.py": "tests/workers/metrics/",
    "tests/workers/common/test_metrics.py": "tests/workers/metrics/",
    "tests/workers/common/test_worker_metrics.py": "tests/workers/metrics/",
    "tests/workers/common/test_internal_auth.py": "tests/workers/transport/",
    "tests/workers/common/test_lockstep_group.py": "tests/workers/group/",
    "tests/workers/common/test_lockstep_modes.py": "tests/workers/group/",
    "tests/workers/common/test_lockstep_runner_stress.py": "tests/workers/group/",
    "tests/workers/common/test_lockstep_stress.py": "tests/workers/group/",
    "tests/workers/common/test_remote_engine_proto.py": "tests/workers/group/",
    "tests/workers/common/test_loads.py": "tests/workers/engine/",
    "tests/workers/common/test_request_failure.py": "tests/workers/engine/",
    "tests/workers/common/test_expert_load_endpoint.py": "tests/workers/api/",
    "tests/workers/common/test_large_prompt.py": "tests/workers/api/",
    "tests/workers/common/test_request_fuzz.py": "tests/workers/api/",
    "tests/workers/common/test_serve_identity.py": "tests/workers/api/",
    "tests/workers/common/test_server_info_kv_bytes.py": "tests/workers/api/",
    "tests/workers/common/test_servicer.py": "tests/workers/api/",
    "tests/workers/common/test_servicer_top_logprobs.py": "tests/workers/api/",
    "tests/workers/common/test_text_pieces.py": "tests/workers/api/",
    "tests/workers/common/test_validation.py": "tests/workers/api/",
    "tests/workers/common/test_prefill_round*.py": "tests/workers/engine/",
}

# Files that hold old paths on purpose (this table, and its test's fixtures) are never rewritten.
NOT_REWRITTEN = ("scripts/relayout.py", "tests/scripts/test_relayout.py")
# Text files whose references are rewritten, besides every .py file.
TEXT_NAMES = ("Makefile", "Dockerfile*", "*.md", "*.toml", "*.cfg", "*.ini", "*.txt", "*.sh", "*.yaml", "*.yml",
              "*.json", "*.tpl", "*.proto", "*.pyi", "*.j2")
PACKAGE = "deepseek_pd"


class RelayoutError(Exception):
    """The table and the tree disagree; nothing was changed."""


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


def unmapped(files: list[str], rows) -> list[str]:
    cut = recut_folders(rows)
    return [f for f in files if any(f.startswith(c) for c in cut)
            and _destination(f, rows) is None and not _is_new_side(f, rows)]


def _depth(path: str) -> int:
    return len(PurePosixPath(path).parts) - 1


def make_plan(root: Path, files: list[str]) -> Plan:
    rows = _rows()
    missing = unmapped(files, rows)
    if missing:
        raise RelayoutError("these files sit in a folder that is being re-cut, and no row of MOVES in "
                            "scripts/relayout.py says where they go (add one row each, then run again):\n  "
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
                if fnmatch.fnmatch(path, old) and PurePosixPath(path).parent == PurePosixPath(old).parent:
                    covered_old[path] = new + PurePosixPath(path).name
                elif PurePosixPath(path).parent == PurePosixPath(new) \
                        and fnmatch.fnmatch(PurePosixPath(path).name, PurePosixPath(old).name):
                    covered_old[str(PurePosixPath(old).parent / PurePosixPath(path).name)] = path
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
    return re.compile(r"(?<![\w.-])(?:" + "|".join(alts) + ")")


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


def rewrite_python(text: str, plan: Plan, regex: re.Pattern | None, depth: tuple[int, int] | None) -> str:
    """Import statements through the syntax tree; every other dotted name and path as text."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return rewrite_paths(rewrite_dotted(text, plan), plan, regex)
    starts = _offsets(text)
    lines = _lines(text)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            s = starts[node.lineno - 1] + _chars(lines[node.lineno - 1], node.col_offset)
            e = starts[node.end_lineno - 1] + _chars(lines[node.end_lineno - 1], node.end_col_offset)
            # A trailing comment on the statement's last line goes with it.
            line_end = text.find("\n", e)
            line_end = len(text) if line_end < 0 else line_end
            rest = text[e:line_end]
            if rest.strip().startswith("#"):
                e = line_end
            edits.append((s, e, node))
    out, pos = [], 0
    for s, e, node in sorted(edits, key=lambda x: x[0]):
        out.append(rewrite_paths(rewrite_dotted(text[pos:s], plan), plan, regex))
        new = _rewrite_import_from(node, text, s, e, plan)
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
            new_text = rewrite_python(text, plan, regex, plan.depth_change.get(path))
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
