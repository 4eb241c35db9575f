# syntax=docker/dockerfile:1
# The image the Kubernetes manifests run (k8s/): elastic-train with torch, as a non-root user.
#
#   CPU (default):  docker build -t REGISTRY/elastic-train:0.1.0-cpu .
#   CUDA:           docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                                -t REGISTRY/elastic-train:0.1.0-cu128 .
#   Your script:    docker build --target with-script --build-context training=./my_project \
#                                -t REGISTRY/my-training:1 .      (see the with-script stage below)
#
# The base image is pinned to an exact version tag; pin it by digest as well (python:3.11.11-slim-bookworm@sha256:...)
# where your registry policy asks for it.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the CPU image free of multi-GB CUDA libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/elastic-train
ENV PATH=/opt/elastic-train/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md /src/
COPY elastic_train /src/elastic_train
# [s3]/[gcs]: object-storage checkpoints; torch is already satisfied by the wheel above.
RUN pip install "/src[s3,gcs]" && rm -rf /src

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="elastic-train" \
      org.opencontainers.image.description="Fault-tolerant elastic training for PyTorch on an etcd v3 rendezvous" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 elastic \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin elastic
COPY --from=build /opt/elastic-train /opt/elastic-train
ENV PATH=/opt/elastic-train/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
WORKDIR /tmp
USER 10001:10001
ENTRYPOINT ["elastic-train"]
CMD ["--help"]

# Your own training script (docs/kubernetes.md, "Your own training script"): the image above with a directory
# of yours at /opt/training, for `elastic-train run ... --entry /opt/training/SCRIPT`. The directory is the
# named build context "training" (--build-context training=DIR); without one, examples/own_loop.py stands
# in. A script that needs more packages: a Dockerfile of your own FROM this image, with its RUN pip install.
FROM scratch AS training
COPY examples/own_loop.py /

FROM runtime AS with-script
COPY --from=training / /opt/training/
WORKDIR /opt/training

# The default target (no --target): the image the manifests run.
FROM runtime
