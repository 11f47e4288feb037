#!/usr/bin/env bash
# Here, before a run on the lent device machine (an H200 host: torch 2.11 + CUDA, Python
# 3.12, no package registry, 64 MiB carried): the wheels kvstrata needs that its image lacks
# (.whl/, the versions of this .venv) and SmolLM2's config + tokenizer (.devrun/smol/; the
# weights are made there, seeded random). Both are in .gitignore; carry them:
#   run(command="BUDGET=480 bash benchmarks/device/run.sh", carry=[".whl", ".devrun"],
#       timeout_s=510)
set -euo pipefail
cd "$(dirname "$0")/../.."
# Not in that image (KINDS.md of the device tool lists what is): the server's, the tests'
# (openai and its client), and newer typing-extensions / anyio than pydantic and fastapi need.
PKGS="gguf msgspec pyzmq fastapi starlette pydantic pydantic_core typing-inspection
annotated-types uvicorn opentelemetry-api typing-extensions anyio openai jiter sniffio
httpx2 httpcore2 truststore idna"
mkdir -p .whl
for p in $PKGS; do
  v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}' || true)
  [ -n "$v" ] || { echo "$p is not in .venv"; exit 1; }
  ls .whl | grep -qi "^$(echo "$p" | tr - _)-$v-" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$p==$v" 2>&1 \
    | grep -v "^WARNING: Location" || true
done
[ -f .devrun/smol/config.json ] || .venv/bin/python benchmarks/random_smollm2.py --meta-only .devrun/smol
du -sh .whl .devrun
