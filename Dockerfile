# The embedcar image used by docker-compose.yml (sidecar, catalog job, demo). It does not prepare
# the model: the export needs the `export` extra (torch, transformers), which this image leaves out,
# and compose mounts models/ read-only. Run `make model` on the host first; compose mounts models/
# and indexes/ (the catalog service and the demo build the index there on first start).
# Never built or run on this project's machines (no Docker engine there); tests/test_compose.py checks
# this file and the compose file without one.
FROM python:3.11-slim
# g++ and gRPC's C++ library: the sidecar's default gRPC server is its compiled front
# (sidecar/native_front.py), built against them; the official image already carries Python's headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libgrpc++-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# The whole context, .dockerignore aside: the packages and the top-level modules pyproject's
# `py-modules` names (embedcar_settings.py, embedcar_docs.py).
COPY . .
RUN pip install --no-cache-dir -c constraints.txt . \
 && pip install --no-cache-dir --no-deps nvidia-pytriton==0.7.0
# Build the compiled front now, from the installed package, into the cache the services read it from
# (root's, inference/native_cache.py), and fail the image if it cannot build: at run time the sidecar
# would otherwise fall back to grpc.aio with one log line nobody reads.
RUN cd / && python -c "import sys; from sidecar.native_front import unavailable_reason; \
reason = unavailable_reason(); sys.exit(f'the compiled gRPC front cannot build: {reason}' if reason else 0)"
ENTRYPOINT ["embedcar"]
