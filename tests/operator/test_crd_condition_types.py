"""Every condition type the operator writes is one the CRD's status schema admits
(operator/crd.py CONDITION_TYPES): the API server refuses a status whose condition type is not in
the enum (HTTP 422), so a new condition missing there left every CR's status empty on a real control
plane, while kmock, which does not validate, passed. Oracle: the operator's own sources."""
from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import deepseek_pd.operator as operator_package
from deepseek_pd.operator.crd import CONDITION_TYPES

_LITERAL = re.compile(r'\bcondition\(\s*"([A-Za-z]+)"')


def _written_condition_types() -> set[str]:
    found: set[str] = set()
    for module_info in pkgutil.iter_modules(operator_package.__path__):
        module = importlib.import_module(f"{operator_package.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, str) and (name == "CONDITION" or name.endswith("_CONDITION")):
                found.add(value)
        found.update(_LITERAL.findall(Path(module.__file__).read_text()))
    return found


def test_every_condition_the_operator_writes_is_in_the_crd_enum():
    written = _written_condition_types()
    assert {"Available", "SecretsReady", "GangScheduling", "RolloutVerified"} <= written  # the scan sees them
    assert written <= set(CONDITION_TYPES), sorted(written - set(CONDITION_TYPES))
