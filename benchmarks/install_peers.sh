#!/usr/bin/env bash
# Install the peers of benchmarks/bench_peers.py into the active environment, beside torch==2.13.0.
#   pip install torch==2.13.0 && bash benchmarks/install_peers.sh && python benchmarks/bench_peers.py --quick
set -euo pipefail
cd "$(dirname "$0")/.."
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0" > "$pin"
# torchsnapshot, torch_checkpointing and safetensors accept torch 2.13 (the constraint keeps it).
pip install -c "$pin" -e ".[peers]"
# ByteCheckpoint 0.0.2 requires torch<=2.5 and would replace torch: install it without its
# dependencies, then the two it imports (its gRPC server: grpcio, and protobuf<4 for its generated
# code).  The others it declares (mmh3, universal-pathlib, cachetools) are never imported.
pip install -c "$pin" --no-deps "bytecheckpoint==0.0.2"
pip install -c "$pin" "grpcio==1.69.0" "protobuf==3.20.3"
