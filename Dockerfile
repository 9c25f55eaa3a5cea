# syntax=docker/dockerfile:1.7
#
# dgserve: gRPC and OpenAI-compatible HTTP serving for DiffusionGemma, as a NIM-style container.
#
#   builder  CUDA devel image: Python venv with a CUDA build of torch, `build.py` (protobuf stubs + the
#            dgserve._C extension with CUDA kernels for sm_90a / sm_100a), the CPU test suite, a wheel, and a
#            clean runtime venv with that wheel installed.
#   runtime  slim CUDA base image: the runtime venv (the server is in the wheel: `dgserve serve`), a non-root
#            user, gRPC on 50051, the OpenAI-compatible API + health + metrics on 8000, the model as /models.
#
#   docker build -t dgserve .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 dgserve               # the small model shipped inside
#   docker run --gpus all -v /data/ckpt:/models:ro -e NIM_MODEL_PATH=/models dgserve
#   docker run --rm dgserve --dry-run                                       # print the resolved configuration
#
# The same file builds a CPU image from a Debian base (DEVICE=cpu, BUILDER_IMAGE / RUNTIME_IMAGE, a CPU torch):
# scripts/build_image.sh --cpu does that with buildah and podman where no CUDA image can be pulled
# (docs/deployment.md, "Building the image here").
#
# Versions (see docs/deployment.md): CUDA 13.0 toolkit, and torch from the matching cu130 wheel index.
# TORCH_VERSION must equal pyproject.toml's `torch==` pin, or installing the dgserve wheel would replace the
# CUDA torch with another build (tests/test_container.py checks that they agree). The lent GPU machines run
# torch 2.11+cu130 on the same CUDA 13.0 runtime; the host needs an NVIDIA driver >= 580 (CUDA 13.0).

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04
# The two bases: CUDA devel for the builder, the slim CUDA base for the runtime. A CPU image passes one Debian
# (or Ubuntu) image with python3, python3-venv and ca-certificates for both, and DEVICE=cpu.
ARG BUILDER_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}
ARG RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU}

# ------------------------------------------------------------------------------------------------ builder
FROM ${BUILDER_IMAGE} AS builder

# cuda: a CUDA torch and the CUDA build of _C (the production image); cpu: a CPU torch and a CPU-only _C.
ARG DEVICE=cuda
ARG TORCH_VERSION=2.13.0
# A CPU build passes an index (or find-links) that serves a CPU build of the same torch version.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG SETUPTOOLS_VERSION=84.2.1
# sm_90a = Hopper (H100/H200) with its arch-specific features, sm_100a = Blackwell (B200/GB200); unused when
# DEVICE=cpu.
ARG CUDA_ARCHES=sm_90a,sm_100a
# 0 skips the CPU test suite and the [test] extra (quicker local iteration; CI images keep the default).
ARG RUN_TESTS=1
ARG DEBIAN_FRONTEND=noninteractive

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Versions of Ubuntu packages are not pinned: the archive drops superseded versions (a pin breaks the build at
# the next security update); the base image tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ openssl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# build.py passes explicit -gencode flags for --arch; TORCH_CUDA_ARCH_LIST says the same to anything else
# that compiles against torch here.
ENV TORCH_CUDA_ARCH_LIST="9.0a;10.0a" \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/build-venv/bin:${PATH}

# The build venv: torch first, frozen into a constraint, so that no later install swaps it for another build.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv /opt/build-venv \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install "setuptools==${SETUPTOOLS_VERSION}" \
    && pip freeze | grep -E '^(torch|setuptools)==' > /opt/constraints.txt \
    && DEVICE="${DEVICE}" python -c "import os, torch; assert bool(torch.version.cuda) == (os.environ['DEVICE'] == 'cuda'), 'torch is not a ' + os.environ['DEVICE'] + ' build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# Dependencies + the [test] extra (when the tests run), from pyproject.toml alone (a layer that survives source
# edits).
WORKDIR /src
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    RUN_TESTS="${RUN_TESTS}" python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + (p['optional-dependencies']['test'] if os.environ['RUN_TESTS'] == '1' else [])))" > /tmp/requirements.txt \
    && pip install -c /opt/constraints.txt -r /tmp/requirements.txt

COPY . .

# Stubs + the extension (fail if the CUDA path was not taken when DEVICE=cuda), then the CPU tests on this tree.
RUN if [ "${DEVICE}" = "cuda" ]; then \
        python build.py --arch "${CUDA_ARCHES}" | tee /tmp/build.log && grep -q "ext: CUDA (" /tmp/build.log; \
    else \
        python build.py --cpu-only | tee /tmp/build.log && grep -q "ext: CPU build" /tmp/build.log; \
    fi \
    && pip install --no-cache-dir -c /opt/constraints.txt --no-deps --no-build-isolation -e . \
    && python -c "import torch, dgserve._C"
RUN if [ "${RUN_TESTS}" = "1" ]; then python -m pytest -q -m "not cuda and not image" -p no:cacheprovider; fi

# The wheel (must carry _C, the generated stubs and the shipped small model), then the runtime venv from it.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --no-build-isolation --wheel-dir /dist . \
    && python docker/check_wheel.py --require-ext /dist/dgserve-*.whl \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -c /opt/constraints.txt "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && /opt/venv/bin/pip install -c /opt/constraints.txt /dist/dgserve-*.whl \
    && /opt/venv/bin/pip check

# ------------------------------------------------------------------------------------------------ runtime
# `base` (CUDA runtime + the container toolkit's NVIDIA_* settings) rather than `runtime`: torch's cu130 wheels
# bring cuBLAS, cuDNN and NCCL as pip packages, so the larger image would only duplicate them.
FROM ${RUNTIME_IMAGE} AS runtime

ARG DEVICE=cuda
ARG DEBIAN_FRONTEND=noninteractive

LABEL org.opencontainers.image.title="dgserve" \
      org.opencontainers.image.description="gRPC serving for DiffusionGemma (block-diffusion Gemma 4 MoE)" \
      org.opencontainers.image.licenses="Apache-2.0"

# python3 for the venv (the /usr/bin/python3 of the builder: the same base release), libgomp1 for the OpenMP CPU
# ops of _C.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 dgserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dgserve --shell /usr/sbin/nologin dgserve \
    && mkdir -p /models \
    && chown 10001:10001 /models

COPY --from=builder /opt/venv /opt/venv
WORKDIR /opt/dgserve
COPY --chmod=0755 docker/entrypoint.sh docker/entrypoint.sh

# NIM-style defaults; each is read by dgserve serve (dgserve/service/__main__.py) and overridden by its flag.
# NIM_MODEL_PATH stays unset: the small model shipped in the package is served (mount a checkpoint at /models and
# set NIM_MODEL_PATH=/models to serve it); NIM_SERVED_MODEL_NAME unset: the model directory's name.
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/dgserve \
    DGSERVE_GRPC_PORT=50051 \
    NIM_SERVER_PORT=8000 \
    NIM_LOG_LEVEL=INFO \
    DGSERVE_DEVICE=${DEVICE} \
    DGSERVE_DRAIN_TIMEOUT=30

VOLUME ["/models"]
# gRPC (dgserve.v1.TextGeneration, grpc.health.v1, reflection); HTTP: /v1/completions, /v1/chat/completions,
# /v1/models, /v1/health/live, /v1/health/ready, /metrics
EXPOSE 50051 8000

USER 10001:10001

# Ready = model loaded and warmed up; the start period covers loading a large checkpoint.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v1/health/ready' % os.environ.get('NIM_SERVER_PORT', '8000'), timeout=4)"]

# SIGTERM drains both front doors: readiness NOT_SERVING / 503 at once, new calls UNAVAILABLE / 503, running
# streams get DGSERVE_DRAIN_TIMEOUT s. Startup that cannot succeed (port in use, missing model, auth or TLS
# file, a model that fails to load) exits 2 with one line on stderr.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/dgserve/docker/entrypoint.sh"]
CMD []
