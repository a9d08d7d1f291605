# kvcr-router: the KV-aware OpenAI front (docs/router.md, docs/kubernetes-vllm.md).
# Build from the repository root:
#   docker build -f deploy/images/kvcr-router.Dockerfile -t kvcr-router:0.1.0 .
# Same shape as kvcr-guard's image: wheels built in a first stage, a slim non-root final
# image with the pinned dependencies (transformers for the tokenizer, no torch).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY packages/kvcr-core packages/kvcr-core
COPY packages/kvcr-router packages/kvcr-router
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels packages/kvcr-core packages/kvcr-router

FROM ${PYTHON_IMAGE}
COPY deploy/images/requirements/router.txt /tmp/requirements.txt
COPY --from=wheels /wheels /tmp/wheels
RUN pip install --no-cache-dir -r /tmp/requirements.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/requirements.txt \
    && groupadd --gid 10001 kvcr \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvcr
ENV HF_HUB_OFFLINE=1
USER 10001:10001
ENTRYPOINT ["kvcr-router"]
CMD ["--help"]
