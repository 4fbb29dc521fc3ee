# stepwatch: one image for the node agent, the processor, compaction and the Grafana/Kafka jobs
# (the Helm chart in helm/stepwatch runs `stepwatch <command>` from it). The product's extras only: the
# development tools (stepwatch/devtools/: demo, simulate, bench, eval, the embedded broker) need
# `stepwatch[devtools]`, whose packages the image does not install.
#
#   docker build -t REGISTRY/stepwatch:0.1.0 .
#
# Runs as the unprivileged user 10001 (the chart's runAsUser). The image also carries py-spy (the
# agent never runs it: the probe in a training image with stepwatch[profiling] does, see
# docs/profiling.md) and nvidia-ml-py (NVML, for GPU metrics when the NVIDIA container runtime
# injects the driver). DuckDB's lake extensions (ducklake, sqlite, postgres, httpfs: the signed binaries
# of the duckdb-ext-* packages pip installs, for this image's platform) are also copied flat into
# /opt/stepwatch/duckdb-extensions; the Grafana pod copies them from there with an init container
# (docs/helm.md, "Grafana"), so the datasource names no platform.

FROM python:3.11-slim AS build
# a C compiler for the probe's hot path (agents/probe/_probefast.c); the runtime stage does not carry it
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY stepwatch/ stepwatch/
COPY agents/ agents/
COPY stream/ stream/
COPY detectors/ detectors/
COPY storage/ storage/
COPY dashboards/ dashboards/
RUN python -m venv /opt/stepwatch \
 && /opt/stepwatch/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/stepwatch/bin/pip install --no-cache-dir ".[agent,grafana,processor,report]" py-spy nvidia-ml-py \
 && /opt/stepwatch/bin/python -m stepwatch.storage.extensions copy /opt/stepwatch/duckdb-extensions

FROM python:3.11-slim
ENV PATH=/opt/stepwatch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 stepwatch \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin stepwatch
COPY --from=build /opt/stepwatch /opt/stepwatch
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["stepwatch"]
CMD ["--help"]
