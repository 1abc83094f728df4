# The embedcar image used by docker-compose.yml (sidecar, catalog job, demo). It does not prepare
# the model: the export needs the `export` extra (torch, transformers), which this image leaves out,
# and compose mounts models/ read-only. Run `make model` on the host first; compose mounts models/
# and indexes/ (the catalog service and the demo build the index there on first start).
# Never built or run on this project's machines (no Docker engine there); tests/test_compose.py checks
# this file and the compose file without one.
FROM python:3.11-slim
# No C++ toolchain and no system gRPC library: the sidecar serves gRPC with grpcio's own C core,
# which its wheel carries (a current release, unlike a distribution's libgrpc++).
WORKDIR /app
# The whole context, .dockerignore aside: the packages and the top-level modules pyproject's
# `py-modules` names (embedcar_settings.py, embedcar_docs.py), and client/, the embedcar-client
# distribution the server depends on by name: named in the same pip command, it is taken from there.
COPY . .
RUN pip install --no-cache-dir -c constraints.txt ./client . \
 && pip install --no-cache-dir --no-deps nvidia-pytriton==0.7.0
ENTRYPOINT ["embedcar"]
