#!/usr/bin/env bash
# Creates .venv and installs peerd with its test and hf (Hugging Face task) extras. Idempotent; safe to
# re-run after pulling. PYTHON and VENV choose another interpreter and venv (scripts/test-pythons makes
# .venv-3.12 and .venv-3.13).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# The build hook (setup.py) compiles protocols/*.proto with grpcio-tools; install the build tools first and
# build without isolation so the generated code matches the protobuf runtime in this venv.
# Machines of this project's kind set pip's extra-index-url to local mirrors that hold only some projects, and
# pip warns once for each project missing from one: about 100 lines a run that say nothing about peerd. Only
# that message is dropped; other warnings and every error still show, and pip's exit status still counts.
pip_install() {
  "$VENV/bin/python" -m pip install --quiet "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
pip_install --upgrade pip
pip_install "setuptools>=77" wheel "grpcio-tools==1.85.1" "torch==2.13.0"
pip_install --no-build-isolation -e ".[test,hf]"
