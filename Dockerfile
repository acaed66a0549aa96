# The deepseek-pd image: workers (`deepseek-pd serve`), the router (smg, the Shepherd Model Gateway) and the
# operator (`deepseek-pd operator run`) all run from it.
#
#   CPU (default):  docker build -t deepseek-pd:cpu .
#   CUDA:           docker build -t deepseek-pd:cuda \
#                     --build-arg BASE_IMAGE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY deepseek_pd deepseek_pd
COPY model model
COPY workers workers
COPY proto proto
COPY operator operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
# CPU wheels by default: a bare `torch` from PyPI would pull a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# libibverbs1: Mooncake's transfer engine (RDMA and TCP); python3 for images without it (the
# unquoted $(...) is meant to expand to several package names, or to none).
# hadolint ignore=SC2046
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       libibverbs1 ibverbs-providers ca-certificates \
       $(command -v python3 >/dev/null || echo python3 python3-pip python3-venv) \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/deepseek-pd
ENV PATH=/opt/deepseek-pd/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/deepseek_pd-*.whl)[serve,operator]" && rm -rf /wheels
# Non-root: the chart runs the operator as uid 1000 with a read-only root filesystem.
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deepseek
USER 1000
WORKDIR /home/deepseek
ENTRYPOINT ["deepseek-pd"]
CMD ["--help"]
