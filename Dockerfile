# The weighbridge images, one per role (docs/architecture.md, "Installs"):
#   docker build --target sidecar -t weighbridge-sidecar .   # the sidecar alone: `.[sidecar]`
#   docker build --target epp -t weighbridge-epp .           # the endpoint picker: `.[epp]`
#   docker build -t weighbridge .                            # everything: `.[all]`
# docker-compose.yml runs the sidecar from the first and the engine emulator and the Locust
# load generator from the second.
FROM python:3.11-slim AS source

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package's sources and its package data; each target below installs from them.
COPY pyproject.toml README.md ./
COPY weighbridge ./weighbridge
COPY emulator ./emulator
COPY sidecar ./sidecar
COPY loadgen ./loadgen
COPY exporters ./exporters
COPY analysis ./analysis
COPY dashboards ./dashboards
# Package data (weighbridge.scenarios, weighbridge.deploy): the image's weighbridge finds
# them in site-packages; /app/scenarios and /app/deploy are what compose mounts over.
COPY scenarios ./scenarios
COPY deploy ./deploy
COPY scripts/restore-opentelemetry-proto.sh ./scripts/

# The sidecar: no Locust, gevent, pandas or matplotlib.
FROM source AS sidecar
RUN pip install '.[sidecar]'
EXPOSE 8000
CMD ["weighbridge", "sidecar", "--help"]

# The endpoint picker (weighbridge epp, docs/deploy-kubernetes.md): the sidecar and gRPC.
FROM source AS epp
RUN pip install '.[epp]' && bash scripts/restore-opentelemetry-proto.sh
# 9002 ext_proc (gRPC, and its health service), 9090 /metrics and /admin.
EXPOSE 9002 9090
CMD ["weighbridge", "epp", "--help"]

# Everything (the default target): the engine emulator and the Locust load generator.
FROM source AS full
RUN pip install '.[all]' && bash scripts/restore-opentelemetry-proto.sh

# Root in the container: Locust writes run directories into ./runs, bind-mounted from the
# host, whose owner the image cannot know.
RUN mkdir -p /app/runs

# 8001 emulator, 8089 Locust's web UI, 9646+ the load generator's exporters.
EXPOSE 8001 8089 9646
CMD ["weighbridge", "--help"]
