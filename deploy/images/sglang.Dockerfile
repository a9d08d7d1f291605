# SGLang with kvcr-sglang: the upstream SGLang image of the verified version (0.5.23), plus
# kvcr-core and kvcr-sglang (HiCache storage backend and unified-cache linker).
# Build from the repository root:
#   docker build -f deploy/images/sglang.Dockerfile -t kvcr-sglang:0.1.0 .
# Pick the upstream tag's CUDA flavour for your drivers with --build-arg SGLANG_IMAGE=...
# Only kvcr's wheels are added (--no-deps): kvcr-core's dependencies are SGLang's own (msgspec,
# prometheus-client, xxhash) or come with transformers (PyYAML), and stay as upstream built
# them. Runs as uid 10001, which no base image or host account uses.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY packages/kvcr-core packages/kvcr-core
COPY packages/kvcr-sglang packages/kvcr-sglang
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels packages/kvcr-core packages/kvcr-sglang

FROM ${SGLANG_IMAGE}
COPY --from=wheels /wheels /tmp/wheels
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && groupadd --gid 10001 kvcr \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvcr
USER 10001:10001
ENTRYPOINT ["python3", "-m", "sglang.launch_server"]
