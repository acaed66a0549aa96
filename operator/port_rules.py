"""The CEL rules of `DeepSeekDeployment.spec` that keep a worker pod's listening ports apart: from each
other (a pod of N ranks serves metrics on N consecutive ports), from the router's, and, with
Mooncake, out of the range where Mooncake's engines bind their own ports at random. The schema
(operator/crd_spec.py `spec_schema`) carries them; the API server applies them at admission and
the operator's validation (operator/validation.py) again.

Example: prefill.port 30000, metrics.port 29999 and gpusPerPod 8 on prefill: the metrics ports
29999..30006 contain prefill.port, so the spec is refused, naming `.metrics.port`.
"""
from __future__ import annotations

from deepseek_pd.env import MOONCAKE_RPC_PORTS
from deepseek_pd.operator.schema_types import rule


def port_rules() -> list[dict[str, str]]:
    """Every port rule of the spec (`x-kubernetes-validations` entries)."""
    return [*_metrics_rules(), *_mooncake_port_rules()]


def _pod_ranks(role: str) -> str:
    """CEL: the ranks one pod of `role` runs, one per GPU (a CPU pod runs one)."""
    return f"(self.{role}.gpusPerPod == 0 ? 1 : self.{role}.gpusPerPod)"


def _clear_of_metrics(port: str, role: str) -> str:
    """CEL: `port` is outside the metrics ports of `role`'s pods (metrics.port + 0 .. ranks per pod - 1)."""
    return f"({port} < self.metrics.port || {port} >= self.metrics.port + {_pod_ranks(role)})"


def _metrics_rules() -> list[dict[str, str]]:
    clear = " && ".join([_clear_of_metrics("self.prefill.port", "prefill"),
                         _clear_of_metrics("self.prefill.bootstrapPort", "prefill"),
                         _clear_of_metrics("self.decode.port", "decode")])
    return [
        rule(f"!self.metrics.enabled || ({clear})",
             "metrics.port .. metrics.port + gpusPerPod - 1 (one port per rank of a pod) must not contain "
             "prefill.port, prefill.bootstrapPort or decode.port", ".metrics.port"),
        rule("!self.metrics.enabled || self.metrics.routerPort != self.router.port",
             "metrics.routerPort must differ from router.port", ".metrics.routerPort"),
    ]


def _mooncake_port_rules() -> list[dict[str, str]]:
    """With Mooncake, no port a worker pod listens on may lie where Mooncake's engines bind their
    own ports at random (env.MOONCAKE_RPC_PORTS): an engine could take it first, and that pod would
    fail at start now and then."""
    low, high = MOONCAKE_RPC_PORTS.start, MOONCAKE_RPC_PORTS.stop
    single = " && ".join(f"({port} < {low} || {port} >= {high})"
                         for port in ("self.prefill.port", "self.prefill.bootstrapPort", "self.decode.port"))
    metrics = " && ".join(f"(self.metrics.port + {_pod_ranks(role)} <= {low} || self.metrics.port >= {high})"
                          for role in ("prefill", "decode"))
    return [rule(f"self.kvTransfer.backend != 'mooncake' || ({single} && (!self.metrics.enabled || ({metrics})))",
                 f"with kvTransfer.backend mooncake, prefill.port, prefill.bootstrapPort, decode.port and the "
                 f"worker metrics ports must lie outside {low}-{high - 1}, where Mooncake's engines bind their "
                 f"own ports at random", ".kvTransfer.backend")]
