# An image of this checkout for Prefect Docker or Kubernetes work pools (docs/orchestration.md):
# its git history included (DVC needs it), installed with the DVC remotes' extras. Data and
# models are not in it: they come from the DVC remote (`dvc pull`, with its credentials).
#   docker build -t visionflow .                       # all four remotes
#   docker build -t visionflow --build-arg EXTRAS=s3 .  # or only the one you use
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/visionflow
ARG EXTRAS=s3,gs,azure,ssh
# the dependencies first, from pyproject.toml alone with an empty package, so that a code
# change does not reinstall torch; the editable install then finds the code copied below
COPY pyproject.toml README.md ./
RUN mkdir -p src/visionflow && touch src/visionflow/__init__.py \
    && pip install --no-cache-dir -e ".[${EXTRAS}]"
COPY . .
# what git tracks under data/, which .dockerignore left out with the data DVC tracks
RUN git ls-files -z data | xargs -0 -r git checkout --
# prefect.yaml's pull step (visionflow.ops.worker.worker_checkout) goes to this checkout
ENV VISIONFLOW_WORKDIR=/opt/visionflow DVC_NO_ANALYTICS=1
# A Docker or Kubernetes worker replaces this command with the flow run's; on its own the image
# runs a process worker for the pool that prefect.yaml deploys to.
CMD ["prefect", "worker", "start", "--pool", "visionflow"]
