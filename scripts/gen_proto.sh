#!/usr/bin/env bash
# Regenerates kvx/v1/*_pb2.py(i) and *_pb2_grpc.py from proto/kvx/v1/*.proto. Never edit the output.
# protoc comes from grpcio-tools 1.76.0 (protobuf 6.31.1 gencode, grpcio 1.76 stubs: the runtime
# floors in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc --version >/dev/null 2>&1 || python -m pip install -q grpcio-tools==1.76.0
python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. proto/kvx/v1/*.proto
# gRPC stubs only for the files that define services.
python -m grpc_tools.protoc -I proto --grpc_python_out=. $(grep -l '^service ' proto/kvx/v1/*.proto)
