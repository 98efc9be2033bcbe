# CPU images, built from the repository root:
#   docker build -f docker/cpu.Dockerfile --target service -t vime-cpu:0.1.0 .
#       slim: the router and reward services only, no torch (they never need it)
#   docker build -f docker/cpu.Dockerfile --target all -t vime-cpu-all:0.1.0 .
#       the whole system on CPU (laptop profile): all four services, the CPU build of torch,
#       megatron-core on gloo ranks and the reference inference engine (the CPU stand-in for vLLM)
#   docker build -f docker/cpu.Dockerfile --target redis -t vime-redis:0.1.0 .
#       Debian's redis-server on the same base, for hosts that cannot pull `redis:` (compose:
#       VIME_REDIS_IMAGE); `all` is built on it, so it costs nothing more once `all` is built
# Python 3.11 and torch 2.13.0 (CPU) match the CI machines, where the CPU path is tested.
# Without a registry (scripts/containers.sh): PYTHON_IMAGE is a Debian rootfs made with
# debootstrap, TORCH_FIND_LINKS a local server of the CPU torch wheel, TORCH_INDEX_URL PyPI.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# --- build: one virtual environment per target, copied whole into the runtime stage ----------
FROM base AS build-service
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY vime ./vime
COPY services/router ./services/router
COPY services/reward ./services/reward
RUN pip install --no-cache-dir . ./services/router ./services/reward

FROM build-service AS build-all
# torch first, from the CPU index, so the services' `torch>=2.6` never pulls a CUDA build. A
# find-links source (a URL listing the CPU wheel) is looked at first when one is given.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=""
COPY docker/cpu-constraints.txt /tmp/constraints.txt
RUN PIP_FIND_LINKS="$TORCH_FIND_LINKS" \
    pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" -c /tmp/constraints.txt torch
COPY services/rollout ./services/rollout
COPY services/trainer ./services/trainer
RUN pip install --no-cache-dir -c /tmp/constraints.txt ".[models]" "./services/rollout[reference]" ./services/trainer

# --- runtime ---------------------------------------------------------------------------------
FROM base AS runtime
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin vime \
    && mkdir -p /models /data /checkpoints /runs /etc/vime \
    && chown vime:vime /models /data /checkpoints /runs
COPY --chmod=0755 docker/entrypoint.sh /opt/vime/entrypoint.sh
COPY docker/healthcheck.py /opt/vime/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /home/vime
ENTRYPOINT ["/opt/vime/entrypoint.sh"]

FROM runtime AS service
COPY --from=build-service /opt/venv /opt/venv
USER 10001:10001
CMD ["python", "-m", "vime_reward", "--help"]

# Debian's redis-server: the Redis image where none can be pulled (it keeps its data in /data,
# which uid 10001 owns), and part of `all`.
FROM runtime AS redis
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
USER 10001:10001
WORKDIR /data
CMD ["redis-server", "--protected-mode", "no", "--dir", "/data"]

FROM redis AS all
# redis-server (from the redis stage) lets `vime train` run the whole system in this one
# container, with a private Redis started by the launcher, when no Redis URL is configured.
COPY --from=build-all /opt/venv /opt/venv
WORKDIR /home/vime
CMD ["vime", "--help"]
