"""Helpers shared by several test folders (fakes, harnesses, the netns runner, the e2e cluster).

pyproject.toml's pytest `pythonpath` puts tests/support on sys.path, so tests import them as
`pdtest.<module>`; scripts that tests run by path get the same folder through PYTHONPATH
(`pdtest.netns.run_in_netns`). Helpers used by one folder only stay in that folder.
"""
