# syntax=docker/dockerfile:1
# The Conveyor image: the Dagster code location (default command), the connector runs
# it launches, and the REST API (`conveyor serve`). No JVM: connector runs are Spark
# Connect clients of the broker executors' Spark servers.
#
#   docker build -t conveyor:0.1.0 .
#   docker run --rm -p 3030:3030 conveyor:0.1.0            # code server, port 3030
#   docker run --rm -p 8083:8083 -e CONVEYOR_API_TOKEN_FILE=/run/secrets/api-token \
#     conveyor:0.1.0 conveyor serve --host 0.0.0.0          # REST API
#
# docs/OPERATIONS.md shows it in a compose file and in Dagster's Helm chart.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY conveyor ./conveyor
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[all,deploy]"

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    CONVEYOR_HOME=/var/lib/conveyor \
    CONVEYOR_CONNECTORS_DIR=/etc/conveyor/connectors
COPY --from=build /wheels /wheels
# --no-index: only the wheels built above, so the versions are those pyproject.toml pins.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --no-index --find-links=/wheels "conveyor[all,deploy]" \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --home-dir /var/lib/conveyor --create-home conveyor \
    && mkdir -p /opt/dagster/dagster_home /etc/conveyor/connectors \
    && chown -R conveyor /opt/dagster/dagster_home /etc/conveyor/connectors
COPY deploy/dagster.yaml /opt/dagster/dagster_home/dagster.yaml
WORKDIR /var/lib/conveyor
USER 10001
EXPOSE 3030 8083
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s \
    CMD ["dagster", "api", "grpc-health-check", "-p", "3030"]
# `dagster code-server start` (not `dagster api grpc`) can reload its definitions in
# place: the scheduler sensor and the REST API reload it when a spec file changes.
CMD ["dagster", "code-server", "start", "-h", "0.0.0.0", "-p", "3030", "-m", "conveyor.dagster.definitions", "--location-name", "conveyor"]
