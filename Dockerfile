# One image for all three dflash-serve services (target, drafter, gateway); compose.yaml picks
# the subcommand. Build: `docker build -t dflash-serve .` (compose.yaml builds it for you).
#
# Base: the official PyTorch CUDA runtime image, tags `<torch>-cuda<X.Y>-cudnn9-runtime`
# (torch >= 2.11 is required). The CUDA version in the tag decides the host driver needed:
#   pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime  NVIDIA driver >= 580 (default)
#   pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime  driver >= 570, for hosts on an older driver
# For another card or driver change only this tag: `--build-arg BASE_IMAGE=...`, or
# `BASE_IMAGE=... docker compose build`.
# Nothing here depends on the card model: the fla-core (gpu extra) Triton kernels and our own
# kernels are compiled at run time, on first use, for the GPU the container runs on, so the
# image carries kernels for the card it runs on. The compiled kernels are cached under
# TRITON_CACHE_DIR on the models volume, so a restart does not compile them again.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Triton builds a small C launcher for each kernel at run time and needs a host C compiler;
# older runtime images ship none (newer ones do, and then this installs nothing).
RUN if ! command -v cc >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# Keep the base image's CUDA build of torch: pip must never swap it for another one.
RUN python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
        > /etc/pip-constraints.txt
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt

WORKDIR /opt/dflash-serve

# Dependencies in their own layer: rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md LICENSE ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself (its dependencies are already there, so this layer is small); then
# import every service's entry module from outside the source tree, so that a module the
# package list misses fails the build, not the container.
COPY dflash_serve ./dflash_serve
COPY dflash_protos ./dflash_protos
COPY target_service ./target_service
COPY drafter_service ./drafter_service
COPY gateway ./gateway
COPY launcher ./launcher
RUN pip install ".[gpu]" \
    && cd / && python -c "import gateway.app, target_service.server, drafter_service.server" \
    && dflash-serve --help > /dev/null

# Non-root user. /models is the shared model cache (a named volume in compose.yaml): a new
# volume takes this directory's ownership, so the services can write to it.
ARG UID=10001
RUN useradd --uid "${UID}" --create-home --shell /usr/sbin/nologin dflash \
    && mkdir -p /models \
    && chown dflash:dflash /models
ENV HF_HOME=/models \
    TRITON_CACHE_DIR=/models/.triton
USER dflash
WORKDIR /home/dflash

# gateway HTTP, target gRPC, drafter gRPC
EXPOSE 8000 50051 50052
ENTRYPOINT ["dflash-serve"]
CMD ["--help"]
