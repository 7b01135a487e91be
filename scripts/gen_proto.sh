#!/usr/bin/env bash
# Regenerate the committed Python stubs from proto/ (CI checks they are current:
# tests/test_proto.py runs this into a temp dir and compares).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/nightjar/v1/inference.proto
