# CPU images, built from the repository root:
#   docker build -f docker/cpu.Dockerfile --target service -t vime-cpu:0.1.0 .
#       slim: the router and reward services only, no torch (they never need it)
#   docker build -f docker/cpu.Dockerfile --target all -t vime-cpu-all:0.1.0 .
#       the whole system on CPU (laptop profile): all four services, the CPU build of torch,
#       megatron-core on gloo ranks and the reference inference engine (the CPU stand-in for vLLM)
# Python 3.11 and torch 2.13.0 (CPU) match the CI machines, where the CPU path is tested.

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
COPY docker/cpu-constraints.txt /tmp/constraints.txt
# torch first, from the CPU index, so the services' `torch>=2.6` never pulls a CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu -c /tmp/constraints.txt torch
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

FROM runtime AS all
# redis-server lets `vime train` run the whole system in this one container, with a private
# Redis started by the launcher, when no Redis URL is configured.
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-all /opt/venv /opt/venv
USER 10001:10001
CMD ["vime", "--help"]
