# Two stages: build the wheel (which runs the protobuf codegen hook), then install it
# into a slim, non-root runtime image next to a pinned torch.
#
#   docker build -t prefixcache:0.1.0 .                                  # CPU torch
#   docker build -t prefixcache:0.1.0-cuda --build-arg TORCH_FLAVOUR=cu128 .  # CUDA torch
#
# tests/deploy/test_dockerfile.py keeps the install and start commands here the same as
# the ones CI and the README run (same torch pin, torch first, the `server` extra,
# `prefixcache serve`), and the HEALTHCHECK the same as the Kubernetes probes.

FROM python:3.11-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
# Only what the wheel is built from, so that a local venv or caches never leak in.
COPY pyproject.toml hatch_build.py README.md .gitignore ./
COPY scripts/ scripts/
COPY protos/ protos/
COPY server/ server/
COPY client/ client/
RUN python -m build --wheel --outdir /dist

FROM python:3.11-slim
# The torch flavour is the index its wheel comes from: cpu (the default) keeps the
# multi-gigabyte CUDA libraries out of the image; a CUDA one (cu128, cu130, ...: any
# index that publishes torch==TORCH_VERSION) brings its CUDA runtime as pip packages, so
# the slim base still suffices: the NVIDIA container toolkit mounts the driver.
ARG TORCH_VERSION=2.13.0
ARG TORCH_FLAVOUR=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_FLAVOUR}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFIXCACHE_LISTEN=unix:/run/prefixcache/prefixcache.sock
# The tier extra's Mooncake wheel links libibverbs.so.1, even over TCP.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
# torch goes first, pinned, so that the wheel's `torch>=2.1` can never pull another build.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
COPY --from=build /dist/ /tmp/dist/
# A local wheel: its version is the one just built.
# hadolint ignore=DL3013
RUN wheel="$(ls /tmp/dist/prefixcache-*.whl)" \
    && pip install "${wheel}[server,tier]" \
    && rm -rf /tmp/dist
# A numeric user, so that Kubernetes' runAsNonRoot can verify it. The socket directory
# belongs to it: mount a volume there to share the socket with the inference container.
RUN groupadd --gid 10001 prefixcache \
    && useradd --create-home --uid 10001 --gid 10001 prefixcache \
    && mkdir -p /run/prefixcache \
    && chown 10001:10001 /run/prefixcache
USER 10001:10001
WORKDIR /home/prefixcache
# Prometheus /metrics (--metrics-port). gRPC is on the unix socket in /run/prefixcache.
EXPOSE 9470
# grpc.health.v1 over PREFIXCACHE_LISTEN; the same command as the Kubernetes probes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["prefixcache", "health"]
CMD ["prefixcache", "serve"]
