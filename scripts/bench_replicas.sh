#!/usr/bin/env bash
# Scale-out measurements of docs/lab-notes/2026-11-24-ray.md: the embedded pair served (a) by the plain
# single-process server with 1 torch thread, (b) by 1 Ray Serve replica x 1 thread, (c) by 2 replicas x 1
# thread; specdec bench-serve against each at 1 and 16 concurrent streams. Needs the ray extra.
# Usage: scripts/bench_replicas.sh OUT_DIR   (prefix with `nice -n 19` on a shared machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/bench_replicas.sh OUT_DIR}
mkdir -p "$out"
port=8391
run() {  # NAME SERVE_ARGS...: start the server, wait for /health, bench, stop it
    local name=$1; shift
    OMP_NUM_THREADS=1 python3 -m specdec.cli serve --port $port --log-level warning "$@" >"$out/$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $pid || { cat "$out/$name.log"; exit 1; }
        sleep 0.5
    done
    python3 -m specdec.cli bench-serve --base-url "http://127.0.0.1:$port/v1" --concurrency 1 \
        --num-requests 8 --max-tokens 32 --json "$out/$name-c1.json" | tee "$out/$name-c1.txt"
    python3 -m specdec.cli bench-serve --base-url "http://127.0.0.1:$port/v1" --concurrency 16 \
        --num-requests 32 --max-tokens 32 --warmup 0 --json "$out/$name-c16.json" | tee "$out/$name-c16.txt"
    kill -TERM $pid; wait $pid || true
}
run plain-1thread
run ray-1x1 --replicas 1 --threads-per-replica 1
run ray-2x1 --replicas 2 --threads-per-replica 1
