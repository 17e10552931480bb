# The image for a Prefect Docker or Kubernetes work pool (docs/orchestration.md): this checkout,
# its git history included (DVC needs it), installed with the DVC remotes' extras. Data, models
# and experiments come from the DVC remote at run time (`dvc pull`), with its credentials.
#   docker build -t visionflow .                       # all four remotes
#   docker build -t visionflow --build-arg EXTRAS=s3 .  # or only the one you use
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/visionflow
ARG EXTRAS=s3,gs,azure,ssh
# the dependencies first, so that a code change does not reinstall torch
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir -e ".[${EXTRAS}]"
COPY . .
# prefect.yaml's pull step sets the flow run's working directory from this
ENV VISIONFLOW_WORKDIR=/opt/visionflow DVC_NO_ANALYTICS=1
CMD ["prefect", "worker", "start", "--pool", "visionflow"]
