# Two commands on a fresh machine: `make demo` (the main job) and `make test` (every test).
# Both create .venv on first use; nothing needs to be installed by hand beforehand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv system-deps control-plane image image-cuda image-push clean

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

# The image (root Dockerfile): `make image` builds the CPU image, which the chart runs as the
# operator (<repo>:<appVersion>) and examples/cpu-minimal.yaml as workers (<appVersion>-cpu);
# `make image-cuda` the workers' CUDA image (<appVersion>-cuda). Push with `make image-push`
# (after `docker login ghcr.io`), or set IMAGE_REPO to your registry. DOCKER=podman works too.
DOCKER ?= docker
IMAGE_REPO ?= ghcr.io/deepseek-pd/deepseek-pd
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"*\([^" ]*\)"*.*/\1/p' charts/Chart.yaml)
CUDA_BASE_IMAGE ?= nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04
CUDA_TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cu130

image:
	@command -v $(DOCKER) >/dev/null || { echo "make image needs $(DOCKER) (or DOCKER=podman)" >&2; exit 1; }
	$(DOCKER) build -t $(IMAGE_REPO):$(IMAGE_TAG) -t $(IMAGE_REPO):$(IMAGE_TAG)-cpu .

image-cuda:
	@command -v $(DOCKER) >/dev/null || { echo "make image-cuda needs $(DOCKER) (or DOCKER=podman)" >&2; exit 1; }
	$(DOCKER) build -t $(IMAGE_REPO):$(IMAGE_TAG)-cuda --build-arg BASE_IMAGE=$(CUDA_BASE_IMAGE) --build-arg TORCH_INDEX_URL=$(CUDA_TORCH_INDEX_URL) .

image-push:
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)-cpu
	$(DOCKER) push $(IMAGE_REPO):$(IMAGE_TAG)-cuda

clean:
	rm -rf $(VENV) build dist *.egg-info
