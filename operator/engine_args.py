"""A role's engineArgs checked as its worker will check them, before any pod runs them.

Each role's `serve` flags are what the operator manages for it (build_workers.worker_serve_flags:
parallelism, speculation, ...) followed by the CR's engineArgs, parsed by the serve contract
(workers/serve/flags.py) and put through `serve`'s flag rules (workers/serve/flag_rules.py), the
very function a worker runs first. So a combination the worker would refuse at start-up, such as
`--engine-opt=cuda_graph=true` on the prefill role or `--enable-tbo` with `parallelism.tp` > 1,
is an InvalidSpec condition naming `<role>.engineArgs` in the worker's words, and no child is made;
without it the pods would crash-loop on it. So is a `--page-size` given to one role and not the
other, or different on each (model/kv/page_size.py `page_size_mismatch`): those workers would start,
and fail every request's KV transfer. Torch-free, as the whole operator.
"""
from __future__ import annotations

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.page_size import page_size_mismatch
from deepseek_pd.operator.build_workers import worker_serve_flags
from deepseek_pd.operator.spec import DeploymentSpec
from deepseek_pd.operator.validation import Violation
from deepseek_pd.workers.serve.flag_rules import check_flags
from deepseek_pd.workers.serve.flags import ServeFlags


def engine_args_violations(spec: DeploymentSpec) -> list[Violation]:
    """One violation per role whose worker would refuse its command line, and one when the two
    roles' page sizes could differ (every request's KV transfer would fail); none: []."""
    found, page_sizes = [], {}
    for role in (spec.prefill, spec.decode):
        managed = worker_serve_flags(spec, role).to_argv()
        try:
            flags = ServeFlags.from_argv([*managed, *role.engine_args])
            check_flags(flags)
        except (UserError, ValueError) as exc:
            found.append(Violation(f"spec.{role.role}.engineArgs", str(exc)))
        else:
            page_sizes[role.role] = flags.page_size
    if len(page_sizes) == 2 and (why := page_size_mismatch(page_sizes["prefill"], page_sizes["decode"])):
        found.append(Violation("spec.decode.engineArgs", why))
    return found
