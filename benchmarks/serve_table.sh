#!/usr/bin/env bash
# Issue 23's serving table: `specdecode bench serve` at C = 1, 4 and 16 against our server (speculation on and
# off) and llama-server (with and without its draft model), the same models and prompts.
#
#   usage: benchmarks/serve_table.sh LLAMA_BIN_DIR TARGET.gguf DRAFT.gguf OUT_DIR
#   LLAMA_BIN_DIR: what ../shared/peers/build_llama_cpp.sh prints. DATASET, NUM_PROMPTS, MAX_TOKENS and ROUNDS
#   may be set in the environment.
#
# Our two servers run at once and their bench runs alternate (C = 1, 4, 16, then the order reversed, ROUNDS
# times), so that both meet the same minutes of a machine whose memory bandwidth moves with its neighbours.
# llama-server runs right after, one configuration at a time (two of them at once would not fit its -c 65536
# slots twice in memory). Each server first gets one warm-up run at C = 16, not reported.
set -euo pipefail
bin=$1; target=$2; draft=$3; out=$4
dataset=${DATASET:-../shared/bench/spec_bench_questions.jsonl}
prompts=${NUM_PROMPTS:-16}; tokens=${MAX_TOKENS:-64}; rounds=${ROUNDS:-2}
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

up() {  # port: wait for /health
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2; return 1
}
bench() {  # port label concurrency tag
  specdecode bench serve --base-url "http://127.0.0.1:$1" --dataset "$dataset" --num-prompts "$prompts" \
    --max-tokens "$tokens" --max-concurrency "$3" --label "$2" --result-json "$out/$2-c$3-$4.json" \
    > "$out/$2-c$3-$4.txt"
}
stop() { kill "$@" 2>/dev/null || true; wait "$@" 2>/dev/null || true; }

specdecode serve --max-num-seqs 16 --port 8101 > "$out/ours.log" 2>&1 & pids+=($!); a=$!
specdecode serve --max-num-seqs 16 --spec-type none --port 8102 > "$out/ours_plain.log" 2>&1 & pids+=($!); b=$!
up 8101; up 8102
bench 8101 ours 16 warmup; bench 8102 ours_plain 16 warmup
for r in $(seq "$rounds"); do
  order="1 4 16"; [ $((r % 2)) = 0 ] && order="16 4 1"
  for c in $order; do
    if [ $((r % 2)) = 1 ]; then bench 8101 ours "$c" "r$r"; bench 8102 ours_plain "$c" "r$r"
    else bench 8102 ours_plain "$c" "r$r"; bench 8101 ours "$c" "r$r"; fi
  done
done
stop "$a" "$b"

for cfg in llama llama_draft; do
  extra=(); [ "$cfg" = llama_draft ] && extra=(-md "$draft")
  "$bin/llama-server" -m "$target" "${extra[@]}" -t 2 -np 16 -c 65536 --port 8103 > "$out/$cfg.log" 2>&1 &
  pids+=($!); p=$!
  up 8103
  bench 8103 "$cfg" 16 warmup
  for r in $(seq "$rounds"); do for c in 1 4 16; do bench 8103 "$cfg" "$c" "r$r"; done; done
  stop "$p"
done

python - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'server':12s} {'round':5s} " + " ".join(f"{'C=' + c + ' tok/s':>12s} {'TTFT p50':>9s}" for c in ("1", "4", "16")))
for f in sorted(out.glob("*-c1-r*.json")):
    label, rnd = f.stem.split("-c1-")
    cells = []
    for c in ("1", "4", "16"):
        s = json.loads((out / f"{label}-c{c}-{rnd}.json").read_text())["runs"][0]["summary"]
        cells.append(f"{s['output_throughput']:12.2f} {s['ttft_ms']['median']:7.0f}ms")
    print(f"{label:12s} {rnd:5s} " + " ".join(cells))
EOF
