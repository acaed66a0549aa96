# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv on first use; nothing needs to be installed by hand beforehand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz venv system-deps control-plane third-party-crds image image-cpu image-cuda image-push clean

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

# kube-apiserver, kube-controller-manager and kube-scheduler for tests/k8s, built once per release into
# ~/.cache/deepseek-pd/kube/<release>/ (about 9 minutes cold on 2 cores; a no-op after). `make test`
# needs no step for it: pytest starts it in the background and runs tests/k8s last.
control-plane:
	@bash scripts/build-control-plane.sh >/dev/null

# CRDs of the kinds the operator renders but Kubernetes does not define (ServiceMonitor, PodGroup),
# from their pinned Go modules into ~/.cache/deepseek-pd/crds/ (a no-op when cached).
third-party-crds:
	@bash scripts/fetch-third-party-crds.sh >/dev/null

# One seed per run, printed first ("random seed: N"), from which every draw of the suite comes.
# `make test` (what CI runs) uses CI_SEED, as hypothesis runs derandomized (profile "ci"): CI's
# draws are a function of the code, so CI cannot pass or fail by the draw, and a failure in CI is
# one on every machine. Fresh draws find what the fixed ones miss: `make test SEED=fresh` (printed),
# scripts/stress-suite.sh (CI's seed first, then fresh ones, from clean clones, under load) and
# `make fuzz`. `make test SEED=N` replays a run; `make test TESTS=tests/launcher` runs a part.
CI_SEED := 2041470325
TESTS ?= tests
test: $(STAMP) system-deps third-party-crds
	$(BIN)/python -m pytest -q -rfEs --durations=15 --hypothesis-profile=ci $(if $(filter fresh,$(SEED)),,--seed $(or $(SEED),$(CI_SEED))) $(TESTS)

# The property tests only, with 20x more examples from a fresh seed (or SEED=N): before a release,
# not in CI. A failure prints the seed and hypothesis' blob that replay it.
fuzz: $(STAMP) system-deps third-party-crds
	$(BIN)/python -m pytest -q -rfEs --durations=15 -m hypothesis --hypothesis-profile=fuzz $(if $(SEED),--seed $(SEED)) $(TESTS)

# The images: `make image` builds the CPU image (Dockerfile) as <repo>:<appVersion>, which the
# chart runs as the operator, and <appVersion>-cpu (examples/cpu-minimal.yaml's workers), and the
# CUDA image (Dockerfile.cuda: DeepEP on NVSHMEM, Mooncake's CUDA build) as <appVersion>-cuda
# (examples/deepseek-v3-h200.yaml); `make image-cpu` / `make image-cuda` build one. Push with
# `make image-push` (after `docker login ghcr.io`), or set IMAGE_REPO to your registry.
# DOCKER=podman works too.
DOCKER ?= docker
IMAGE_REPO ?= ghcr.io/deepseek-pd/deepseek-pd
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"*\([^" ]*\)"*.*/\1/p' charts/Chart.yaml)

image: image-cpu image-cuda

image-cpu:
	@command -v $(DOCKER) >/dev/null || { echo "make image needs $(DOCKER) (or DOCKER=podman)" >&2; exit 1; }
	$(DOCKER) build -f Dockerfile -t $(IMAGE_REPO):$(IMAGE_TAG) -t $(IMAGE_REPO):$(IMAGE_TAG)-cpu .

image-cuda:
	@command -v $(DOCKER) >/dev/null || { echo "make image needs $(DOCKER) (or DOCKER=podman)" >&2; exit 1; }
	$(DOCKER) build -f Dockerfile.cuda -t $(IMAGE_REPO):$(IMAGE_TAG)-cuda .

image-push:
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)-cpu
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)-cuda

clean:
	rm -rf $(VENV) build dist *.egg-info
