# The weighbridge image: the sidecar, the engine emulator and the Locust load generator
# (docker-compose.yml runs each from it). Build: docker build -t weighbridge .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package first (its layer changes only with the code), then what is mounted or read
# at run time.
COPY pyproject.toml README.md ./
COPY weighbridge ./weighbridge
COPY emulator ./emulator
COPY sidecar ./sidecar
COPY loadgen ./loadgen
COPY exporters ./exporters
COPY analysis ./analysis
COPY dashboards ./dashboards
RUN pip install .

COPY scenarios ./scenarios
COPY deploy ./deploy

# Root in the container: Locust writes run directories into ./runs, bind-mounted from the
# host, whose owner the image cannot know.
RUN mkdir -p /app/runs

# 8000 sidecar, 8001 emulator, 8089 Locust's web UI, 9646+ the load generator's exporters.
EXPOSE 8000 8001 8089 9646
CMD ["weighbridge", "--help"]
