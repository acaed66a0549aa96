"""The CRD schema of `prefill.autoscaling` and `decode.autoscaling` (operator/autoscaler.py).

A role with `autoscaling` has its `replicas` set by the operator from the SLO metrics its pods
export (operator/autoscale_metrics.py names them); without it, `replicas` is the user's (or an
HPA's, through the scale subresource). Worked example, decode held to a 50 ms p90 TPOT and 85%
of the KV pool, 1 to 4 groups:

    decode:
      autoscaling:
        minReplicas: 1
        maxReplicas: 4
        metrics: [{name: tpotP90Seconds, target: 0.05}, {name: kvCacheUsage, target: 0.85}]
"""
from __future__ import annotations

from deepseek_pd.operator.autoscale_metrics import ROLE_METRICS
from deepseek_pd.operator.schema_types import Schema, array, integer, obj, rule, string

_METRIC_DOCS = {
    "ttftP90Seconds": "p90 time to first token on the prefill workers, in seconds",
    "queueDepthPerGroup": "requests waiting in the prefill workers' queues, per group",
    "tpotP90Seconds": "p90 time per output token on the decode workers, in seconds",
    "kvCacheUsage": "used fraction (0-1) of the decode workers' KV pools, mean over ranks",
}


def autoscaling_schema(role: str) -> Schema:
    names = ROLE_METRICS[role]
    metric = obj("One SLO target.", {
        "name": string("The metric: " + "; ".join(f"{n}: {_METRIC_DOCS[n]}" for n in names) + ".",
                       enum=list(names)),
        "target": {"type": "number", "minimum": 0,
                   "description": "The value the role is scaled to hold the metric at (> 0)."},
    }, required=["name", "target"], rules=[rule("double(self.target) > 0.0", "target must be > 0", ".target")])
    return obj(
        f"Scale the {role} groups from their serving metrics, read from the pods by the operator "
        f"(no Prometheus needed); replicas is then set by the operator. Per metric as the "
        f"HorizontalPodAutoscaler: ceil(groups * value / target), the highest over the metrics, "
        f"within [minReplicas, maxReplicas], stabilised both ways. Leave it unset to drive "
        f"replicas yourself or through the scale subresource.", {
            "minReplicas": integer("Fewest groups.", minimum=1, maximum=1000, default=1),
            "maxReplicas": integer("Most groups.", minimum=1, maximum=1000),
            "metrics": {**array("The SLO targets (at least one).", metric, max_items=len(names)),
                        "minItems": 1},
            "scaleUpStabilizationSeconds": integer(
                "Groups are added only to the lowest recommendation of this many past seconds (a "
                "burst must last this long).", minimum=0, maximum=3600, default=60),
            "scaleDownStabilizationSeconds": integer(
                "Groups are removed only down to the highest recommendation of this many past "
                "seconds (idleness must last this long).", minimum=0, maximum=86400, default=300),
        }, required=["maxReplicas", "metrics"], rules=[
            rule("self.minReplicas <= self.maxReplicas",
                 f"{role}.autoscaling.minReplicas must be <= maxReplicas", ".minReplicas"),
            rule("self.metrics.all(m, self.metrics.exists_one(n, n.name == m.name))",
                 f"{role}.autoscaling.metrics names a metric twice", ".metrics"),
        ])
