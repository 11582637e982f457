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
# llama.cpp compiles here; skip the parts rsb does not use.
ENV CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF"
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[llama]"

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
RUN useradd --create-home rsb
USER rsb
ENV RSB_HOST=0.0.0.0 RSB_PORT=8000 RSB_CACHE_DIR=/home/rsb/.cache/rsb
EXPOSE 8000
# rsb is PID 1 and handles SIGTERM itself: a consumer drains its SSE readers (retry hint, clean close) and a
# generator finishes or hands over its job. See docs/deployment.md for the grace periods.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rsb"]
CMD ["up", "--host", "0.0.0.0"]
