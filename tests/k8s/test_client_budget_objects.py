"""`router.clientBudget` on a REAL kube-apiserver: the CRD's schema admits a budget and refuses one
that admits nothing or names a header no HTTP request can carry, with the server's message."""
from __future__ import annotations

import random

import pytest
from kube_rest import KubeError
from test_autoscaling_objects import _spec
from test_weights_objects import dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _create(admin_kube, dsd_path, budget: dict) -> dict:  # noqa: F811
    spec = _spec()
    spec["router"] = {**spec.get("router", {}), "clientBudget": budget}
    return admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                        "metadata": {"name": f"cb{random.randrange(10**6)}"}, "spec": spec})


def test_the_server_admits_a_budget_and_refuses_bad_ones(admin_kube, dsd_path):  # noqa: F811
    rpm = random.randint(1, 1_000_000)
    created = _create(admin_kube, dsd_path, {"requestsPerMinute": rpm, "clientHeader": "X-Real-IP"})
    assert created["spec"]["router"]["clientBudget"] == {"requestsPerMinute": rpm, "clientHeader": "X-Real-IP"}
    for budget, message in [({"requestsPerMinute": 0}, "should be greater than or equal to 1"),
                            ({"clientHeader": "X-Real-IP"}, "requestsPerMinute: Required value"),
                            ({"requestsPerMinute": 5, "clientHeader": "X Real IP"}, "should match")]:
        with pytest.raises(KubeError) as refused:
            _create(admin_kube, dsd_path, budget)
        assert refused.value.status == 422 and message in str(refused.value), refused.value
