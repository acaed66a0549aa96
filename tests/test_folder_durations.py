"""The run's time by folder (pdtest.folder_durations) files each test under its top folder."""
from __future__ import annotations

from pdtest.folder_durations import folder_of


def test_a_test_counts_for_its_top_folder():
    assert folder_of("tests/workers/common/test_x.py::test_y[a/b]") == "tests/workers"
    assert folder_of("tests/k8s/test_env_admission.py::test_z") == "tests/k8s"
    assert folder_of("tests/test_seeding.py::test_a") == "tests"
    assert folder_of("test_suite.py::test_a") == "."
