"""`deepseek-pd operator run|crd|check`: the Kubernetes operator and its helpers.

    deepseek-pd operator run (--namespace NS ... | --all-namespaces) [--resync-seconds S] [--liveness-port P]
                                                  [--readiness-port P]
    deepseek-pd operator crd [--output FILE]     the CRD YAML (the chart ships exactly this)
    deepseek-pd operator check --namespace NS ...  can this service account reach the CRD? (helm test)
    deepseek-pd operator plan FILE [--model-dir DIR]  would it fit? (the MemoryPlanFits condition)
"""
from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator, print its CRD")
    actions = parser.add_subparsers(dest="operator_command", required=True, metavar="ACTION")

    run = actions.add_parser("run", help="run the operator (kopf) against the current cluster")
    # No default scope: watching the whole cluster needs cluster-wide RBAC, so it is asked for.
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true",
                       help="watch every namespace (needs cluster-wide RBAC)")
    run.add_argument("--resync-seconds", type=float, default=10.0,
                     help="how often every DeepSeekDeployment is re-checked (default 10)")
    run.add_argument("--liveness-port", type=int, default=0,
                     help="serve kopf's /healthz on this port (0 = off)")
    run.add_argument("--readiness-port", type=int, default=0,
                     help="serve /readyz on this port: 200 once kopf has started and the API server "
                          "answers with the operator's credentials (0 = off)")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    run.set_defaults(func=_run)

    crd = actions.add_parser("crd", help="print the DeepSeekDeployment CRD as YAML")
    crd.add_argument("--output", default="-", help="file to write (default: stdout)")
    crd.add_argument("--role-scale", action="store_true",
                     help="the DeepSeekRoleScale CRD instead (each role's scale subresource)")
    crd.set_defaults(func=_crd)

    check = actions.add_parser("check", help="verify the CRD is served and readable (helm test)")
    check.add_argument("--namespace", action="append", required=True, metavar="NS",
                       help="a namespace to list in (repeatable)")
    check.set_defaults(func=_check)

    plan = actions.add_parser("plan", help="print the memory plan of a DeepSeekDeployment manifest")
    plan.add_argument("file", help="a DeepSeekDeployment YAML manifest")
    plan.add_argument("--model-dir", default=None,
                      help="plan with this checkpoint's config.json instead of the known shape the "
                           "spec names (model.architecture, or recognised by name)")
    plan.set_defaults(func=_plan)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from deepseek_pd.errors import UserError
    from deepseek_pd.operator.handlers import OperatorConfig, run_operator

    if args.resync_seconds <= 0:
        raise UserError(f"--resync-seconds must be > 0, got {args.resync_seconds}")
    if not args.namespace and not args.all_namespaces:
        raise UserError("name the namespaces to watch: --namespace NS (repeatable) or --all-namespaces")
    kopf.configure(verbose=args.verbose)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    config = OperatorConfig(resync_seconds=args.resync_seconds)
    asyncio.run(run_operator(config, namespaces=tuple(args.namespace), liveness_endpoint=liveness,
                             readiness_port=args.readiness_port))
    return 0


def _crd(args: argparse.Namespace) -> int:
    from deepseek_pd.operator.crd import crd_yaml
    from deepseek_pd.operator.role_scale import role_scale_crd_yaml

    text = role_scale_crd_yaml() if args.role_scale else crd_yaml()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0


def _check(args: argparse.Namespace) -> int:
    import asyncio
    import functools
    import logging

    import aiohttp
    import kopf

    from deepseek_pd.errors import UserError
    from deepseek_pd.operator import names
    from deepseek_pd.operator.handlers import default_login
    from deepseek_pd.operator.kube import ApiError, KubeClient

    async def check() -> int:
        login = functools.partial(default_login, settings=kopf.OperatorSettings(),
                                  logger=logging.getLogger("deepseek-pd"))
        client = KubeClient(login)
        try:
            for namespace in args.namespace:
                try:
                    items = await client.list(names.KIND, namespace, {})
                except (ApiError, aiohttp.ClientError, kopf.LoginError) as exc:
                    raise UserError(f"cannot list {names.PLURAL} in {namespace}: {exc}") from exc
                print(f"ok: {names.CRD_NAME} is served; {len(items)} in namespace {namespace}")
        finally:
            await client.close()
        return 0

    return asyncio.run(check())


def _plan(args: argparse.Namespace) -> int:
    """Prints the MemoryPlanFits condition the operator would set; exit status 1 when it refuses."""
    import yaml

    from deepseek_pd.errors import UserError
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.operator.memory_plan import plan_memory
    from deepseek_pd.operator.spec import DeploymentSpec

    try:
        with open(args.file, encoding="utf-8") as handle:
            body = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"cannot read {args.file}: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("spec"), dict):
        raise UserError(f"{args.file}: expected a DeepSeekDeployment manifest with a spec")
    meta = body.get("metadata") or {}
    spec = DeploymentSpec.parse(meta.get("name", "plan"), meta.get("namespace", "default"), body["spec"])
    model = (args.model_dir, ModelConfig.from_hf(args.model_dir)) if args.model_dir else None
    verdict = plan_memory(spec, model)
    status = "Unknown" if verdict.status is None else str(verdict.status)
    print(f"MemoryPlanFits: {status} ({verdict.reason})\n{verdict.message}")
    return 1 if verdict.refused else 0
