#!/usr/bin/env bash
# On the lent device machine (after benchmarks/device/prepare.sh here; carry .whl and
# .devrun): one budgeted run of the checks a CPU-speed or CUDA session needs there, each stage
# under its own time limit so the whole fits BUDGET seconds (default 480; give run() a
# timeout_s ~30 s above it). Stages (STAGES picks and orders them):
#   kernel   the C kernels' tests on this CPU's ISA (AVX-512 / AMX there), GPU hidden
#   cuda     tests/cuda with the GPU visible (make test-cuda)
#   gemm     bench_gemm.py bf16 and int8: kvstrata's own GEMMs (forced) against oneDNN's at
#            1-512 rows on every core, the layers' shapes and the output head's apart: where
#            each wins on this CPU; bf16_avx512: kvstrata's kernels capped at AVX-512 (on AMX
#            the bf16 GEMM's AVX512-BF16 tiles, not its AMX ones); int8_amx: the int8 GEMM
#            with KVSTRATA_CPU_INT8_GEMM=amx (AMX-INT8 tiles). GEMM_KINDS picks.
#   attn     bench_prefill_attention.py: the prefill attention kernel against torch's SDPA,
#            fp32 and bf16 (on AMX bf16 prompts over 1024 tokens stay on SDPA: prefill_max_tokens)
#   step     bench_decode_step.py B=32 C=128 (STEP_VARIANTS): fp32, bf16, bf16 capped at
#            AVX-512 (no AMX in kvstrata's GEMM), bf16 on oneDNN's GEMMs alone, w8a8 (a
#            suffix _own: kvstrata's GEMM for every row count; w8a8_amx: the int8 GEMM on
#            AMX-INT8 tiles; _sdpa: prefill attention on
#            torch's SDPA, not kvstrata's kernel); PREFILL tokens as
#            PREFILL_PROMPTS prompts: a prefill's profile too
#   served   run_vllm_cpu.sh (RUNS): fp32, bf16 (auto), bf16 capped at AVX-512, bf16 on
#            kvstrata's GEMM for every row count, w8a8 (SmolLM2's shapes, random weights)
#   threads  fp32 vs bf16 (auto, oneDNN's alone) on THREADS_LIST cores (default "4 8";
#            taskset + OMP_NUM_THREADS): decode steps, then served: whether the AMX bf16 row
#            holds at few cores
#   probe    --dtype auto's start-up measurement (python -m kvstrata.runner.cpu.dtype_probe) on
#            PROBE_THREADS cores (default "2 8 16"): its verdict beside the table's row
#   suite    the whole CPU suite on 14 workers (what fits the rest of the budget)
# CPU figures hide the GPU (CUDA_VISIBLE_DEVICES=): with it visible the platform is cuda.
# Results: $OUT/device_results.tgz (every log and JSON) and a summary on stdout. A dry run
# here: PATH=<dir with a python3 that runs .venv's> SKIP_PIP=1 STAGES=step bash ... .
# KERNEL_TESTS: the kernel stage's test files (default: the C kernels' ten).
cd "$(dirname "$0")/../.."
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET:-480}))
STAGES=${STAGES:-kernel cuda gemm step served}
R=/tmp/device_results; rm -rf $R; mkdir -p $R
stage() {  # name, seconds, command...: runs it under what is left of the budget
  local name=$1 lim=$2 s; shift 2
  local left=$((DEADLINE - $(date +%s))); [ "$lim" -gt "$left" ] && lim=$left
  [ "$lim" -lt 10 ] && { echo "== $name: no time left"; return 1; }
  s=$(date +%s); echo "== $name (up to ${lim}s)"
  timeout -k 5 "$lim" "$@" > "$R/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - s ))s"
  tail -n "${TAILN:-4}" "$R/$name.log" | cut -c1-250; return $rc
}
finish() { mkdir -p "${OUT:-/tmp}"; tar czf "${OUT:-/tmp}/device_results.tgz" -C $R .
           echo "total $(( $(date +%s) - T0 ))s"; }
{ lscpu; nvidia-smi -L; python3 -V
  python3 -c "import torch; print('torch', torch.__version__, torch.get_num_threads())"
} > $R/machine.txt 2>&1
grep -E "^Model name|^CPU\(s\)" $R/machine.txt; tr ' ' '\n' < $R/machine.txt | \
  grep -E "^(avx512_bf16|avx512_vnni|amx_bf16|amx_int8|avx2)$" | tr '\n' ' '; echo
tail -2 $R/machine.txt
[ -n "${SKIP_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $R/pip.log 2>&1 || { tail $R/pip.log; finish; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
TAILN=1 stage build 90 python3 setup.py build_ext --inplace || { finish; exit 1; }
# which body the bf16 GEMM runs here (3: AMX tiles, 2: AVX512-BF16), and the OpenMP
# runtime(s) loaded once torch and the kernels are (one: they share torch's team)
python3 -c "import torch; from kvstrata.runner.cpu import _bf16_ops, _cpu_ops; \
print('bf16 GEMM body', _bf16_ops.kernel_isa(3), 'omp', sorted({l.split()[-1] for l in \
open('/proc/self/maps') if 'omp' in l}))" 2>&1 | tail -1 | tee -a $R/machine.txt
TAILN=1 stage model 60 python3 benchmarks/random_smollm2.py /tmp/smol --from .devrun/smol \
  || { finish; exit 1; }
CPU_ONLY=(env CUDA_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES=)
for st in $STAGES; do case $st in
  kernel) c=tests/correctness
    tests=${KERNEL_TESTS:-$c/test_bf16_gemm.py $c/test_decode_plan.py $c/test_f32_gemv.py
      $c/test_int8_linear.py $c/test_int8_gemm_amx.py $c/test_packed_linear.py
      $c/test_paged_decode_kernel.py $c/test_prefill_attention_kernel.py
      $c/test_w8a8_int8.py $c/test_cpu_ops.py tests/kv/test_rowcopy.py
      tests/unit/test_cpu_dtype_rule.py}
    TAILN=2 stage kernel 120 "${CPU_ONLY[@]}" OMP_NUM_THREADS=2 python3 -m pytest -q -n 8 \
      -p no:cacheprovider -rfE $tests
    grep -E "^(FAILED|ERROR)" $R/kernel.log | cut -c1-200 | head -12 ;;
  cuda) TAILN=6 stage cuda 120 env KVSTRATA_TEST_CUDA=1 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/cuda ;;
  gemm) for k in ${GEMM_KINDS:-bf16 bf16_avx512 int8 int8_amx}; do
      isa=$([ "${k%_avx512}" != "$k" ] && echo avx512 || echo auto)  # the ISA capped there
      igemm=$([ "${k%_amx}" != "$k" ] && echo amx || echo own)  # int8 on AMX-INT8 tiles
      TAILN=14 stage "gemm_$k" 60 "${CPU_ONLY[@]}" KVSTRATA_CPU_BF16_GEMM=own \
        KVSTRATA_CPU_INT8_GEMM=$igemm KVSTRATA_CPU_ISA=$isa python3 benchmarks/bench_gemm.py \
        --kind "${k%_*}" --rows 1 8 32 64 128 512 --rounds 3 --head --out "$R/gemm_$k.json"
    done ;;
  attn) TAILN=8 stage attn 90 "${CPU_ONLY[@]}" python3 benchmarks/bench_prefill_attention.py \
      --lengths 128 512 2048 --dtypes float32 bfloat16 --isas avx512 --rounds 3 ;;
  step) for v in ${STEP_VARIANTS:-float32 bfloat16 bfloat16_avx512 bfloat16_onednn w8a8}; do
      case $v in  # the variant's flags, and its kernel choice (onednn: oneDNN's GEMM alone;
        # avx512: kvstrata's kernels capped there, on AMX the bf16 GEMM's AVX512-BF16 tiles)
        w8a8*) flags=(--quantization w8a8_int8 --dtype float32) ;;
        *) flags=(--dtype "${v%_*}") ;;
      esac
      case $v in *_onednn) gemm=onednn ;; *_own) gemm=own ;; *) gemm=auto ;; esac
      igemm=$([ "${v%_amx}" != "$v" ] && echo amx || echo $gemm)  # w8a8_amx: AMX-INT8 tiles
      isa=$([ "${v%_avx512}" != "$v" ] && echo avx512 || echo auto)
      pa=$([ "${v%_sdpa}" != "$v" ] && echo 0 || echo 1)  # _sdpa: prefill attention on SDPA
      TAILN=0 stage "step_$v" 60 "${CPU_ONLY[@]}" KVSTRATA_CPU_PREFILL_ATTENTION=$pa \
        KVSTRATA_CPU_BF16_GEMM=$gemm \
        KVSTRATA_CPU_INT8_GEMM=$igemm KVSTRATA_CPU_ISA=$isa python3 \
        benchmarks/bench_decode_step.py --model /tmp/smol \
        "${flags[@]}" --batch 32 --context 128 --prefill "${PREFILL:-0}" \
        --prefill-prompts "${PREFILL_PROMPTS:-1}" --rounds 2 --out "$R/step_$v.json"
      grep -E "GEMM peak|alone|C=128   kernel|^prefill" "$R/step_$v.log" | cut -c1-200
    done ;;
  served) TAILN=10 stage served 300 "${CPU_ONLY[@]}" OUT=$R/served PY=python3 \
      KVSTRATA="python3 -m kvstrata.entrypoints.cli" MODEL=/tmp/smol HF_DIR=/tmp/smol \
      EOS_FLAG=--ignore-eos ROUNDS=${ROUNDS:-1} \
      RUNS="${RUNS:-kvstrata_fp32 kvstrata_bf16 kvstrata_bf16_avx512 kvstrata_bf16_own
            kvstrata_w8a8}" \
      bash benchmarks/run_vllm_cpu.sh ;;
  threads) for t in ${THREADS_LIST:-4 8}; do
      pin=(taskset -c "0-$((t - 1))" env OMP_NUM_THREADS="$t")
      for v in float32 bfloat16 bfloat16_onednn; do
        gemm=$([ "${v%_onednn}" != "$v" ] && echo onednn || echo auto)
        TAILN=0 stage "step_${v}_t$t" 60 "${CPU_ONLY[@]}" "${pin[@]}" \
          KVSTRATA_CPU_BF16_GEMM=$gemm python3 benchmarks/bench_decode_step.py \
          --model /tmp/smol --dtype "${v%_onednn}" --batch 32 --context 128 --prefill 0 \
          --rounds 2 --out "$R/step_${v}_t$t.json"
        grep -E "C=128   kernel" "$R/step_${v}_t$t.log" | cut -c1-120
      done
      TAILN=3 stage "served_t$t" 150 "${CPU_ONLY[@]}" "${pin[@]}" OUT="$R/served_t$t" PY=python3 \
        KVSTRATA="python3 -m kvstrata.entrypoints.cli" MODEL=/tmp/smol HF_DIR=/tmp/smol \
        EOS_FLAG=--ignore-eos RUNS="kvstrata_fp32 kvstrata_bf16 kvstrata_bf16_onednn" \
        bash benchmarks/run_vllm_cpu.sh
    done ;;
  probe) for t in ${PROBE_THREADS:-2 8 16}; do
      TAILN=0 stage "probe_t$t" 60 "${CPU_ONLY[@]}" taskset -c "0-$((t - 1))" \
        env OMP_NUM_THREADS="$t" python3 -m kvstrata.runner.cpu.dtype_probe --model /tmp/smol \
        --threads "$t"
      tr -d '\n ' < "$R/probe_t$t.log" | grep -oE '"ratios".{0,60}|"probe":\["[a-z0-9]+"|"new":"[a-z0-9]+"'
    done ;;
  suite) TAILN=20 stage suite 600 "${CPU_ONLY[@]}" OMP_NUM_THREADS=2 python3 -m pytest -q -n 14 \
      -m "not slow" -p no:cacheprovider --timeout 120 --maxfail=40 -rfE tests ;;
  *) echo "unknown stage $st" ;;
esac; done
finish
