#!/usr/bin/env bash
# Regenerate the committed Python stubs from proto/ (CI checks they are current:
# tests/nightjar/test_proto.py runs this into a temp dir and compares).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/nightjar/v1/inference.proto
# The SDK (its own distribution, nightjar-client) carries the same stubs, importing each other
# relatively, so that it installs without the server package.
mkdir -p "$out/nightjar_client/_v1"
for f in inference_pb2.py inference_pb2.pyi inference_pb2_grpc.py; do
  sed 's/^from nightjar\.v1 import inference_pb2 as/from . import inference_pb2 as/' "$out/nightjar/v1/$f" \
    > "$out/nightjar_client/_v1/$f"
done
