# Sourced by the benchmark scripts that start servers one at a time (run_vllm_cpu.sh,
# run_llama_server.sh): wait for one to answer, stop one.
wait_up() {  # url, server pid, its log: up to 300 s, less if the server exits first
  for _ in $(seq 1 300); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited:"; tail -5 "$3"; return 1; }
    sleep 1
  done
  return 1
}
stop() {  # SIGINT, 30 s to exit, then SIGKILL
  kill -INT "$1" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -9 "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
