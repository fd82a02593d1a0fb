#!/usr/bin/env bash
# Creates .venv and installs peerd with its test extras. Idempotent; safe to re-run after pulling.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The build hook (setup.py) compiles protocols/*.proto with grpcio-tools; install the build tools first and
# build without isolation so the generated code matches the protobuf runtime in this venv.
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "setuptools>=68" wheel "grpcio-tools==1.85.1" "torch==2.13.0"
.venv/bin/python -m pip install --quiet --no-build-isolation -e ".[test]"

