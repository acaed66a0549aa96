# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv on first use; nothing needs to be installed by hand beforehand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv system-deps control-plane clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would download a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the tests need: libibverbs1 for Mooncake, iproute2 for network namespaces.
system-deps:
	@bash scripts/system-deps.sh

demo: $(STAMP) system-deps
	$(BIN)/deepseek-pd demo

# kube-apiserver + kube-controller-manager for tests/k8s, built once per release into
# ~/.cache/deepseek-pd/kube/<release>/ (about 13 minutes cold on 2 cores; a no-op after).
control-plane:
	@bash scripts/build-control-plane.sh >/dev/null

test: $(STAMP) system-deps control-plane
	$(BIN)/python -m pytest -q -rs --durations=15 tests

clean:
	rm -rf $(VENV) build dist *.egg-info
