# peerd in a container; used by docker-compose.yml (docs/docker.md).
#
#   docker build -t peerd .                         # with an image registry and PyPI (torch: PyTorch's CPU index)
#   scripts/docker-wheelhouse && docker build --build-arg BASE_IMAGE=peerd-base:bookworm -t peerd .
#                                                   # offline: wheels from the host, base from debootstrap
#                                                   # (scripts/docker-base-image); the build downloads nothing
#
# Two stages. The builder makes a venv in /opt/peerd with the dependencies from pyproject.toml and builds
# peerd's wheel in a second venv (grpcio-tools compiles protocols/*.proto there); the final stage copies the
# dependency venv and installs the wheel, so a source change rebuilds only the small last layers. With a
# wheelhouse in the build context (.docker-wheels/, from scripts/docker-wheelhouse) pip installs from it alone
# (--no-index); without one it downloads, torch==2.13.0 from PyTorch's CPU index, so no CUDA build comes in.
# Only the legacy builder's features are used (no BuildKit).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
# pyproject.toml always exists; the glob adds the wheels of .docker-wheels/ when that directory exists
COPY pyproject.toml .docker-wheel[s] /wheelhouse/
# The requirements first (the slow layer), read from pyproject.toml: a source change does not reinstall them.
# torch's C++ headers (10k files, only for compiling extensions) are left out of the image.
RUN set -eu; \
    python3 -c 'import tomllib; d = tomllib.load(open("/wheelhouse/pyproject.toml", "rb")); \
open("/tmp/requirements.txt", "w").write("\n".join(d["project"]["dependencies"]) + "\n"); \
open("/tmp/build-requirements.txt", "w").write("\n".join(d["build-system"]["requires"]) + "\n")'; \
    python3 -m venv /opt/peerd; \
    python3 -m venv /opt/build; \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
      echo "installing from the wheelhouse ($(ls /wheelhouse/*.whl | wc -l) wheels), no downloads"; \
      set -- --no-index --find-links /wheelhouse; \
    else \
      echo "no .docker-wheels/ in the build context: downloading (torch from $TORCH_INDEX_URL)"; \
      /opt/peerd/bin/pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' /tmp/requirements.txt)"; \
      set --; \
    fi; \
    /opt/peerd/bin/pip install "$@" -r /tmp/requirements.txt; \
    /opt/build/bin/pip install "$@" -r /tmp/build-requirements.txt; \
    if /opt/peerd/bin/pip list 2>/dev/null | grep -qiE '^(nvidia-|triton )'; then \
      echo "CUDA packages came in; torch must be the CPU build" >&2; exit 1; \
    fi; \
    rm -rf /opt/peerd/lib/python3.11/site-packages/torch/include
COPY setup.py pyproject.toml /src/
COPY protocols /src/protocols
COPY peerd /src/peerd
# README.md is only the package's long description: a stub keeps README edits from rebuilding the image.
# The .proto modules are generated first: setup.py lists the packages before its build step generates
# peerd/proto, so a wheel built from a clean tree would lack them (harmless once setup.py adds the package).
WORKDIR /src
RUN echo "peerd: see the repository's README.md" > README.md \
    && /opt/build/bin/python -c 'import setuptools; setuptools.setup = lambda **_: None; \
import setup; setup.compile_protos()' \
    && /opt/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /dist . \
    && python3 -c 'import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist(); \
assert any(n.startswith("peerd/proto/") for n in names), "peerd/proto missing from the wheel"' /dist/peerd-*.whl

FROM ${BASE_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY --from=builder /opt/peerd /opt/peerd
COPY --from=builder /dist /tmp/dist
RUN /opt/peerd/bin/pip install --quiet --no-deps --no-index /tmp/dist/peerd-*.whl \
    && rm -rf /tmp/dist \
    && /opt/peerd/bin/peerd --version
COPY scripts/docker-entrypoint.sh /usr/local/bin/peerd-entrypoint
COPY configs /opt/peerd-configs
# OMP_NUM_THREADS=1: several peers share a few cores; more threads per peer would only contend.
ENV PATH=/opt/peerd/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
WORKDIR /opt/peerd-configs
# 31337: libp2p (DHT, averaging, expert calls). The control endpoint (7710) stays on the container's loopback.
EXPOSE 31337
ENTRYPOINT ["peerd-entrypoint"]
CMD ["peerd", "start", "--config", "/opt/peerd-configs/docker.yaml"]
# Healthy = the daemon's control endpoint answers /status (cheap enough to run every few seconds; the same as
# `peerd status --control http://127.0.0.1:7710 --json`, without loading the CLI).
HEALTHCHECK --interval=10s --timeout=8s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:7710/status', timeout=6).read()"]
