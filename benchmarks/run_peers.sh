#!/usr/bin/env bash
# Serving peers, one at a time, measured by the same client (kvstrata bench serve):
# 32 concurrent requests, prompt ~128, output 64. See benchmarks/peers.md.
#   PEERS_VENV: a venv with 'transformers[serving]' and llama-cpp-python (+ sse-starlette,
#   starlette-context, pydantic-settings); not the project's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS_VENV=${PEERS_VENV:-/tmp/peers}
OUT=${OUT:-benchmarks/results}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
TINY_DIR=${TINY_DIR:-$HOME/.cache/kvstrata-tests/tiny-llama-smollm2-tok-v1}
.venv/bin/python -m kvstrata.bench.box_load ${REQUIRE_QUIET:+--require-quiet}  # load average at start; busy box = loud warning
GGUF=$(.venv/bin/python -c "from kvstrata.config.model_source import resolve_model_path as r; print(r('smollm2-135m').gguf_path)")
BENCH=(.venv/bin/kvstrata bench serve --num-prompts 64 --concurrency 32 --input-len 128
       --output-len 64 --no-ignore-eos --temperature 0)
mkdir -p "$OUT"
[ -d "$HF_DIR" ] || .venv/bin/python benchmarks/export_smollm2_hf.py "$HF_DIR"

wait_up() { for _ in $(seq 1 180); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
# transformers serve may hang after SIGINT: give each server 20 s, then SIGKILL.
stop() {
  kill -INT "$1" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -9 "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

run_kvstrata() {  # name model_dir [extra serve flags...]
  local name=$1 dir=$2; shift 2
  .venv/bin/kvstrata serve --model-path "$dir" --served-model-name "$name" --port 30100 \
      --page-size 16 --max-total-tokens 65536 "$@" > "$OUT/serve_kvstrata_$name.log" 2>&1 &
  local pid=$!; wait_up http://127.0.0.1:30100/health
  "${BENCH[@]}" --base-url http://127.0.0.1:30100 --model "$name" --output-json "$OUT/serve_kvstrata_$name.json"
  stop $pid
}
run_transformers() {  # name model_dir
  "$PEERS_VENV/bin/transformers" serve --continuous-batching --host 127.0.0.1 --port 8000 \
      "$2" > "$OUT/serve_transformers_$1.log" 2>&1 &
  local pid=$!; wait_up http://127.0.0.1:8000/v1/models
  "${BENCH[@]}" --base-url http://127.0.0.1:8000 --model "$2" --no-usage \
      --output-json "$OUT/serve_transformers_$1.json" --baseline-json "$OUT/serve_kvstrata_$1.json"
  stop $pid
}
run_llamacpp() {
  "$PEERS_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port 8001 \
      --n_ctx 8192 --model_alias smollm2 --interrupt_requests False > "$OUT/serve_llamacpp_smollm2.log" 2>&1 &
  local pid=$!; wait_up http://127.0.0.1:8001/v1/models
  "${BENCH[@]}" --base-url http://127.0.0.1:8001 --model smollm2 \
      --output-json "$OUT/serve_llamacpp_smollm2.json" --baseline-json "$OUT/serve_kvstrata_smollm2.json"
  # the w8a8 goal is against llama.cpp: print that ratio too (when kvstrata_w8a8 ran first)
  [ -f "$OUT/serve_kvstrata_smollm2_w8a8.json" ] && .venv/bin/python -c "import json, sys; \
r = [json.load(open(p))['output_throughput'] for p in sys.argv[1:]]; \
print(f'kvstrata w8a8 / llama.cpp: {r[0] / r[1]:.2f}x')" \
      "$OUT/serve_kvstrata_smollm2_w8a8.json" "$OUT/serve_llamacpp_smollm2.json"
  stop $pid
}

# PEERS="kvstrata kvstrata_w8a8 transformers llamacpp" by default; e.g. PEERS=llamacpp to
# rerun one.
PEERS=${PEERS:-kvstrata kvstrata_w8a8 transformers llamacpp}
for peer in $PEERS; do
  case $peer in
    kvstrata) run_kvstrata smollm2 "$HF_DIR"; [ -d "$TINY_DIR" ] && run_kvstrata tiny "$TINY_DIR" ;;
    kvstrata_w8a8) run_kvstrata smollm2_w8a8 "$HF_DIR" --quantization w8a8_int8 ;;
    transformers) run_transformers smollm2 "$HF_DIR"; [ -d "$TINY_DIR" ] && run_transformers tiny "$TINY_DIR" ;;
    llamacpp) run_llamacpp ;;
  esac
done
