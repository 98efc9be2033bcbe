# GPU image for the colocated pair (trainer + rollout manager with its vLLM engines), built from
# the repository root:
#   docker build -f docker/gpu.Dockerfile -t vime-gpu:0.1.0 .
# Pins, and why:
#   CUDA 13.0 devel on Ubuntu 24.04: torch 2.11 is built for CUDA 13.0 (cu130) and wants an R580+
#     driver (the H200 hosts run 580); the devel image keeps nvcc for the kernels vLLM and its
#     dependencies compile just in time. Ubuntu 24.04 brings Python 3.12, as on the GPU hosts.
#   torch 2.11.0 (cu130 index) + vLLM 0.26.0: 0.26.0 is the newest vLLM release built against
#     torch 2.11, the version on the GPU hosts (DESIGN.md §9); it has the sleep/wake, pause/resume
#     and IPC weight-transfer routes the system drives (notes/vllm_device.md).
#   megatron-core 0.16.1: the version services/trainer pins (one version for CPU CI and GPU).
#   ray 2.60.0: the trainer's Megatron ranks are Ray actors; vLLM's IPC weight-transfer engine
#     also imports ray at module level.
# TransformerEngine and apex are left out on purpose: the trainer uses Megatron's local layer spec
# with torch SDPA attention.

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# gcc and the Python headers stay in the runtime image: triton builds its launcher stubs at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# --- build: the heavy, pinned stack first (cached across source changes), then vime ---------
FROM base AS build
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/gpu-constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu130 -c /tmp/constraints.txt torch \
    && pip install --no-cache-dir -c /tmp/constraints.txt vllm "ray[default]" megatron-core
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vime ./vime
COPY services/rollout ./services/rollout
COPY services/trainer ./services/trainer
RUN pip install --no-cache-dir -c /tmp/constraints.txt ".[models]" "./services/rollout[reference]" ./services/trainer

# --- runtime ---------------------------------------------------------------------------------
FROM base AS runtime
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin vime \
    && mkdir -p /models /data /checkpoints /runs /cache /etc/vime \
    && chown vime:vime /models /data /checkpoints /runs /cache
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 docker/entrypoint.sh /opt/vime/entrypoint.sh
COPY docker/healthcheck.py /opt/vime/healthcheck.py
# Compile caches under /cache (a volume in compose and the chart), so torch Inductor's and Triton's
# kernels and vLLM's torch.compile artefacts (XDG_CACHE_HOME/vllm) outlive the container. PCI
# order in every container of the colocated pair, whatever order the runtime lists the GPUs in,
# so device N is the same physical GPU for the trainer and for vLLM.
ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    TRITON_CACHE_DIR=/cache/triton \
    CUDA_DEVICE_ORDER=PCI_BUS_ID \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
USER 10001:10001
WORKDIR /home/vime
ENTRYPOINT ["/opt/vime/entrypoint.sh"]
CMD ["vime", "--help"]
