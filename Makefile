# Two commands for a newcomer: `make demo` (set up everything, start the typeahead demo) and
# `make test` (set up everything, run every test). Both create .venv and prepare the model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := models/all-MiniLM-L6-v2/manifest.json
# The tritonserver binary and Python backend come from this wheel. Installed without its
# dependencies: we use only the binary, and its Python API pins numpy < 2.
PYTRITON := nvidia-pytriton==0.7.0

.PHONY: install model demo test faults lint docs lock clean browser native allocator java infinity gpu-bundle gpu-check

$(STAMP): pyproject.toml client/pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# setuptools' notice on every editable install (our packages sit at the top level) says nothing
	@# a newcomer can act on: that one message only is silenced.
	@# The client's distribution first (client/, embedcar-client): the server depends on it by name,
	@# which only this checkout provides.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -c constraints.txt -e ./client
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -c constraints.txt -e '.[export,tune,dev,ray,tools]'
	$(BIN)/pip install -q --no-deps $(PYTRITON)
	touch $@

install: $(STAMP)

$(MODEL): $(STAMP)
	$(BIN)/embedcar model prepare

model: $(MODEL)

demo: $(MODEL) allocator
	$(BIN)/embedcar demo

test: $(MODEL) browser native allocator java
	$(BIN)/python -m pytest -q -ra

# The fault suite at full length (tens of minutes, wants an otherwise idle machine): docs/reliability.md.
faults: $(MODEL)
	$(BIN)/embedcar faults --out docs/faults

# Debian's Chromium for the browser test (Playwright's own browser download can't work here).
# Best effort: without it that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
	  || echo "chromium could not be installed: the browser test will be skipped"; }

# gRPC's C++ library (and Python's headers) for the load generator's compiled sender, a benchmark client
# (loadtest/native_build.py builds it on first use; the sidecar itself serves with grpc.aio). Best
# effort: without them its tests skip and say why.
native:
	@{ test -f /usr/include/grpcpp/generic/generic_stub.h && test -f "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h"; } || { \
	  (apt-get update -qq && apt-get install -y -qq g++ libgrpc++-dev python3-dev) >/dev/null 2>&1 \
	  || echo "libgrpc++-dev could not be installed: the compiled sender's tests will be skipped"; }

# mimalloc, the sidecar's malloc where it is installed (sidecar/allocator.py; Debian 12 names it
# libmimalloc2.0, later releases libmimalloc3). Best effort: without it the sidecar uses the C library's.
allocator:
	@$(PY) -c 'import ctypes.util, sys; sys.exit(ctypes.util.find_library("mimalloc") is None)' || { \
	  (apt-get update -qq && { apt-get install -y -qq libmimalloc2.0 || apt-get install -y -qq libmimalloc3; }) >/dev/null 2>&1 \
	  || echo "mimalloc could not be installed: the sidecar will use the C library's malloc"; }

# Debian's grpc-java, its runtime jars and protoc plugin, and a JDK for the Java client (sidecar/java/,
# built by sidecar/java_client.py, which names the packages; no Maven). Best effort: without them the
# Java client's tests skip and say why.
java: $(STAMP)
	@$(BIN)/python -m sidecar.java_client --check >/dev/null 2>&1 || { \
	  (apt-get update -qq && apt-get install -y -qq $$($(BIN)/python -m sidecar.java_client --packages)) >/dev/null 2>&1 \
	  || echo "grpc-java could not be installed: the Java client's tests will be skipped"; }

# Infinity (infinity-emb) in its own venv, for `embedcar bench serving` and `loadtest --target infinity`.
# torch 2.13.0 first: a CPU wheel on local disk (any other pin downloads a multi-GB CUDA build).
infinity:
	$(PY) -m venv var/infinity-venv && var/infinity-venv/bin/pip install -q torch==2.13.0 && var/infinity-venv/bin/pip install -q 'infinity-emb[optimum,server]==0.0.78'

# What travels to a lent GPU machine (docs/gpu.md): a trimmed tritonserver, the wheels its image lacks and
# MiniLM's config and tokenizer, in var/gpu-bundle/ with manifest.json; fails when tree + bundle > 60 MiB.
gpu-bundle: $(STAMP)
	$(BIN)/python -m loadtest.bench.gpu --build-bundle

# The check itself, run ON the GPU machine through the device tool (its python3 holds torch; no venv
# there): the report goes to $$OUT, else reports/gpu. Without a GPU it says so and exits 2.
gpu-check:
	$(PY) -m loadtest.bench.gpu --out "$${OUT:-reports/gpu}"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy .

# The reference pages docs/settings.md and docs/metrics.md, written from the code (a test fails when they are stale).
docs: $(STAMP)
	$(BIN)/embedcar docs reference

# Regenerate the lock file from the current venv (after changing dependencies).
lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(nvidia-pytriton|pip|setuptools)==' > constraints.txt

clean:
	rm -rf $(VENV) models var indexes reports
