#!/usr/bin/env bash
# Builds corral, starts a `corral dev` pool (8 simulated RTX 5090s, data in ./corral-data),
# runs a first job on one GPU, shows its state, output and the pool, then stops the pool.
# CORRAL_BIN (a corral binary to use instead of building one), CORRAL_ENDPOINT and
# CORRAL_DATA_DIR change those defaults (the README's test runs it that way).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${CORRAL_BIN:-}" ]; then
  corral=$CORRAL_BIN
else
  cargo build --release -p corral-cli
  corral=target/release/corral
fi
endpoint=${CORRAL_ENDPOINT:-127.0.0.1:7070}
data_dir=${CORRAL_DATA_DIR:-./corral-data}
log=$(mktemp)

"$corral" dev --data-dir "$data_dir" --listen "$endpoint" >"$log" 2>&1 &
pool=$!
trap 'kill -TERM $pool 2>/dev/null; wait $pool 2>/dev/null || true; rm -f "$log"' EXIT

for _ in $(seq 1 300); do
  grep -q "corral dev ready" "$log" && break
  kill -0 $pool 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
grep "corral dev ready" "$log"

export CORRAL_ENDPOINT=$endpoint
job=$("$corral" submit --gpus 1 --name first-job -- sh -c 'echo "hello from GPU $CUDA_VISIBLE_DEVICES on $CORRAL_NODE"')
echo "submitted job $job"
"$corral" wait "$job" --timeout 60s
"$corral" logs "$job"
"$corral" show "$job"
"$corral" nodes
