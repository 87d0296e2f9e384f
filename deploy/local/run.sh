#!/usr/bin/env bash
# One command, no containers: an S3-compatible server on loopback (moto, from pip), a bucket, a
# 2-rank torchrun job that async-saves to it, a second run that resumes from the latest checkpoint,
# then `ckptd verify` of the last one.  The server is stopped on exit, whatever happens.
#
#   pip install -e ".[s3]" "moto[server]>=5"   # once
#   bash deploy/local/run.sh
#
# Settings (environment): PYTHON (default: python3), PORT (default: a free one), BUCKET,
# STEPS (default 6; the second run goes to 2*STEPS), NPROC (default 2).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
BUCKET="${BUCKET:-ckptd-local}"
STEPS="${STEPS:-6}"
NPROC="${NPROC:-2}"
PORT="${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-testing}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-testing}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ENDPOINT="http://127.0.0.1:${PORT}"
export CKPTD_CHECKPOINT_URL="s3://${BUCKET}/runs/local"
export CKPTD_STORAGE_OPTIONS="{\"endpoint_url\": \"${ENDPOINT}\"}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ckptd-deploy-local.XXXXXX")"
SERVER=""
cleanup() {
    if [[ -n "${SERVER}" ]]; then
        kill "${SERVER}" 2>/dev/null || true
        wait "${SERVER}" 2>/dev/null || true
    fi
    rm -rf "${WORK}"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

echo "== S3-compatible server (moto) on ${ENDPOINT}"
"$PYTHON" -m moto.server -H 127.0.0.1 -p "${PORT}" >"${WORK}/server.log" 2>&1 &
SERVER=$!
"$PYTHON" - "$ENDPOINT" "$BUCKET" <<'PY'
import sys, time, urllib.request

import boto3

endpoint, bucket = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 30
while True:
    try:
        urllib.request.urlopen(endpoint, timeout=1)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"the S3 server at {endpoint} did not start")
        time.sleep(0.2)
boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
print(f"bucket {bucket} created")
PY

TORCHRUN=(torchrun)
command -v torchrun >/dev/null 2>&1 || TORCHRUN=("$PYTHON" -m torch.distributed.run)

echo "== first run: steps 1..${STEPS}"
"${TORCHRUN[@]}" --standalone --nproc_per_node "${NPROC}" "${HERE}/train.py" --steps "${STEPS}" --save-every 3

echo "== second run: resumes from the latest checkpoint, steps ..$((2 * STEPS))"
"${TORCHRUN[@]}" --standalone --nproc_per_node "${NPROC}" "${HERE}/train.py" --steps "$((2 * STEPS))" --save-every 3

echo "== ckptd ls / verify"
"$PYTHON" -m ckptd ls "${CKPTD_CHECKPOINT_URL}" --storage-options "${CKPTD_STORAGE_OPTIONS}"
"$PYTHON" -m ckptd verify "${CKPTD_CHECKPOINT_URL}/checkpoint-$((2 * STEPS))" \
    --storage-options "${CKPTD_STORAGE_OPTIONS}"
echo "== done"
