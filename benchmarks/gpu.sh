#!/usr/bin/env bash
# The prepared one-GPU run: the CUDA tests (tests/lightning/test_cuda.py: fp32, bf16 and fp16 on ZeRO 0/2/3 against the
# per-example oracle), then the benchmark (benchmarks/gpu.py): step-time cases at GPT-2-small width (d 768), fp16
# and bf16, the batch-128 naive-loop speed-up, and a host + GPU profile of ZeRO-3 non-DP / layer-wise / all-layer
# (--profile REGEX); JSON under $OUT (default .), the table printed last. Under
# 8 minutes on one H200 (less with --budget-s). Installs nothing from the network.
#
#   bash benchmarks/gpu.sh            # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --smoke    # on a CPU: tiny sizes, same code paths, a few minutes (proves it works)
#   bash benchmarks/gpu.sh --full     # the full-size run (GPT-2 small; Llama-style 1B with GQA, full and LoRA;
#                                     # bf16-mixed ZeRO-3, micro-batch 8, T 1024; no CUDA tests first). Over one
#                                     # 10-minute call: split it, --full --only gpt2 then --full --only llama
#   bash benchmarks/gpu.sh --full --smoke   # the same families at tiny sizes on a CPU
#   bash benchmarks/gpu.sh --prepare-wheels   # HERE (network), once: wheels the GPU image lacks -> .whl/
#
# The GPU image has torch, lightning and matplotlib but not DeepSpeed, dp-accounting or Opacus. Prepare
# their wheels here with --prepare-wheels (.whl/ is git-ignored), then carry .whl to the GPU machine
# (device tool: carry [".whl"]); this script installs them with pip --no-index into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python

if [[ "${1:-}" == "--prepare-wheels" ]]; then
  mkdir -p .whl
  plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
  # pure-Python or manylinux wheels of what the image lacks (and their missing dependencies)
  "$PY" -m pip download --no-deps "${plat[@]}" -d .whl dp-accounting==0.6.0 opacus==1.6.0 hjson \
      pydantic pydantic-core annotated-types typing-inspection dm-tree
  # DeepSpeed ships only a source archive: build a pure-Python wheel (its ops compile lazily, unused here)
  DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps -w .whl deepspeed==0.19.8
  ls -la .whl
  exit 0
fi

if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'PY' || true
import importlib
for m in ("torch", "lightning", "deepspeed", "dp_accounting", "opacus", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:14s} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{m:14s} MISSING ({type(e).__name__}): configurations that need it will fail and be listed")
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY
if [[ "${1:-}" != "--smoke" && "${1:-}" != "--full" ]]; then
  # first the CUDA code path against the per-example oracle (fp32, bf16-mixed and fp16 on ZeRO 0/2/3, noise drawn
  # on the GPU): a failure is reported and the benchmark still runs. Its log and JUnit report go under $OUT.
  timeout "${CUDA_TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/lightning/test_cuda.py \
      --junitxml "${OUT:-.}/cuda_tests.xml" 2>&1 | tee "${OUT:-.}/cuda_tests.log" || true
fi
exec "$PY" -m benchmarks.gpu "$@"
