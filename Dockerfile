# Tandem: one image for the broker, the local cluster and the Kubernetes operator, and a
# variant with PySpark and Java for the audit (target `audit`).
#   podman build -t tandem:dev .        (or deploy/build-image.sh, which needs no registry)
#   podman build --target audit -t tandem:audit .
# BASE is any Debian-like image with python3 (3.11+) and its venv module; the default is the
# official slim Python image.
ARG BASE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE} AS build
# A C compiler and Python's headers, for this stage only: the install compiles the broker's
# hot modules with mypyc (setup.py). The official image has the headers; Debian's python3
# needs python3-dev.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { python3 -c 'import sysconfig, os, sys; \
sys.exit(not os.path.exists(sysconfig.get_path("include") + "/Python.h"))' \
        || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tandem
COPY pyproject.toml setup.py README.md constraints.txt /src/
COPY src /src/src
RUN /opt/tandem/bin/pip install --no-cache-dir --disable-pip-version-check \
    -c /src/constraints.txt "/src[operator]"

FROM build AS build-audit
RUN /opt/tandem/bin/pip install --no-cache-dir --disable-pip-version-check \
    -c /src/constraints.txt "/src[operator,audit]"

# The audit: Spark's driver and executors on Kubernetes (a SparkApplication), or local mode.
# (Before the default target: a build without --target makes the last stage, `tandem`.)
FROM ${BASE} AS audit
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin tandem
COPY --from=build-audit /opt/tandem /opt/tandem
COPY deploy/image/audit.py /opt/tandem/audit.py
COPY deploy/image/spark-entrypoint.sh /opt/tandem/spark-entrypoint.sh
ENV PATH=/opt/tandem/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    SPARK_HOME=/opt/tandem/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/tandem/bin/python3 PYSPARK_DRIVER_PYTHON=/opt/tandem/bin/python3
USER 10001
WORKDIR /tmp
ENTRYPOINT ["/opt/tandem/spark-entrypoint.sh"]
CMD ["tandem", "audit", "--help"]

FROM ${BASE} AS tandem
COPY --from=build /opt/tandem /opt/tandem
COPY deploy/image/tandem.yaml /etc/tandem/tandem.yaml
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/tandem \
        --shell /usr/sbin/nologin tandem \
    && mkdir -p /var/lib/tandem && chown 10001:10001 /var/lib/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001
WORKDIR /var/lib/tandem
VOLUME /var/lib/tandem
# amqp, amqps, replication, admin (/health, /ready, /status, /metrics)
EXPOSE 5672 5671 5673 15672
HEALTHCHECK --interval=10s --timeout=2s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:15672/health', timeout=2)"]
ENTRYPOINT ["tandem"]
CMD ["broker", "--config", "/etc/tandem/tandem.yaml"]
