# Two stages: build the wheel (which runs the protobuf codegen hook), then
# install it into a slim runtime image with a CPU-only torch.

FROM python:3.11-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir build
# Only what the wheel is built from, so that a local venv or caches never leak in.
COPY pyproject.toml hatch_build.py README.md .gitignore ./
COPY scripts/ scripts/
COPY protos/ protos/
COPY server/ server/
COPY client/ client/
RUN python -m build --wheel --outdir /dist

FROM python:3.11-slim
# The CPU index keeps the multi-gigabyte CUDA libraries out of the image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
COPY --from=build /dist/ /tmp/dist/
RUN wheel="$(ls /tmp/dist/prefixcache-*.whl)" \
    && pip install "${wheel}[server]" \
    && rm -rf /tmp/dist
RUN useradd --create-home --uid 10001 prefixcache
USER prefixcache
WORKDIR /home/prefixcache
CMD ["prefixcache", "serve"]
