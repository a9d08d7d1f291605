# kvcr-guard: the daemon that owns the kvcr pool (docs/kubernetes-guard.md).
# Build from the repository root:
#   docker build -f deploy/images/kvcr-guard.Dockerfile -t kvcr-guard:0.1.0 .
# The first stage turns the repository's packages into wheels (pure Python); the final image
# holds Python, the pinned dependencies and the two wheels: no compiler, no pip cache, no
# source tree. It runs as uid 10001, the uid the engine containers run as (--allowed-uid).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY packages/kvcr-core packages/kvcr-core
COPY packages/kvcr-guard packages/kvcr-guard
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels packages/kvcr-core packages/kvcr-guard

FROM ${PYTHON_IMAGE}
COPY deploy/images/requirements/guard.txt /tmp/requirements.txt
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps -r /tmp/requirements.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/requirements.txt \
    && groupadd --gid 10001 kvcr \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvcr
USER 10001:10001
ENTRYPOINT ["kvcr-guard"]
CMD ["--help"]
