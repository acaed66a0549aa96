# The deepseek-pd CPU image: workers (`deepseek-pd serve`), the router (smg, the Shepherd Model
# Gateway) and the operator (`deepseek-pd operator run`) all run from it. The GPU workers' image,
# with DeepEP and Mooncake's CUDA build, is Dockerfile.cuda; `make image` builds both.
#
#   docker build -t deepseek-pd:cpu .

FROM python:3.11-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY deepseek_pd deepseek_pd
COPY model model
COPY workers workers
COPY proto proto
COPY operator operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
# CPU wheels: a bare `torch` from PyPI would pull a multi-GB CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# libibverbs1: Mooncake's transfer engine (RDMA and TCP).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       libibverbs1 ibverbs-providers ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/deepseek-pd
ENV PATH=/opt/deepseek-pd/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/deepseek_pd-*.whl)[serve,operator]" && rm -rf /wheels
# Non-root, uid 10001 (>= 10000: no clash with a host account): the chart and the operator run
# every pod as this uid (podSecurity.runAsUser) with a read-only root filesystem.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin deepseek
USER 10001
WORKDIR /home/deepseek
ENTRYPOINT ["deepseek-pd"]
CMD ["--help"]
