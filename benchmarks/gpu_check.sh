#!/usr/bin/env bash
# The GPU check, in one command on a machine with an NVIDIA GPU, nvcc and python3:
#   1. builds the extension and the CUDA microbenchmarks for this GPU's architecture,
#   2. runs the GPU tests (pytest -m gpu) against the references,
#   3. runs the CUDA microbenchmarks (Google Benchmark) and tree attention vs torch SDPA,
#   4. times decode (ours vs HF transformers) and offloading end to end on the GPU,
#   5. prints achieved GB/s as a fraction of the device's peak (memory clock x bus width).
# Each stage has a timeout and all of it stays under 8 minutes. A torch without CUDA skips the
# Python stages; the C++ microbenchmarks still run. Results (JSON and the log) go to $OUT if set,
# else build/gpu_check/. Offline machines: put wheels (*.whl, e.g. gguf, torch) and Debian
# packages (*.deb: libbenchmark-dev and its library) in $SPECINFER_DEPS (default .deps/).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/build/gpu_check}
WORK=${SPECINFER_GPU_CHECK_WORK:-/tmp/specinfer-gpu-check}
DEPS=${SPECINFER_DEPS:-$ROOT/.deps}
BUDGET=460 # seconds for all stages; the 8-minute promise minus a margin
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" "$WORK"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
export PATH=$PATH:/usr/local/cuda/bin
failed=()

say() { echo "gpu_check: $*"; }

# stage NAME LIMIT CMD...: runs CMD under a timeout of LIMIT seconds or what is left of BUDGET.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    say "$name: skipped, the time budget is spent"
    failed+=("$name (no time left)")
    return 1
  fi
  say "== $name (at most ${limit}s) =="
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  ((rc == 124)) && say "$name: timed out after ${limit}s"
  if ((rc != 0)); then
    say "$name: FAILED (exit $rc)"
    failed+=("$name")
  fi
  return $rc
}

no_gpu() {
  say "no GPU: $1"
  printf '{"gpu": null, "error": "%s"}\n' "$1" >"$OUT_DIR/summary.json"
  exit 2
}

# --- what this machine has ---
command -v nvidia-smi >/dev/null || no_gpu "nvidia-smi not found (no NVIDIA driver); run this on a GPU machine"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
((gpus > 0)) || no_gpu "nvidia-smi lists no GPU"
command -v nvcc >/dev/null || no_gpu "nvcc not found: the CUDA kernels cannot be built"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
[[ $arch =~ ^[0-9]+$ ]] || arch="80;90"
say "building for sm_$arch with $(nvcc --version | tail -1)"

cmake_prefix=""
if compgen -G "$DEPS/*.deb" >/dev/null; then # e.g. Google Benchmark on a machine without it
  for deb in "$DEPS"/*.deb; do dpkg -x "$deb" "$WORK/prefix"; done
  cmake_prefix="$WORK/prefix/usr"
fi
if compgen -G "$DEPS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/site" "$DEPS"/*.whl
fi
export PYTHONPATH="$WORK/pkg:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch" 2>/dev/null; then
  say "$PY has no torch: creating a venv with torch==2.13.0"
  stage venv 150 bash -c "'$PY' -m venv '$WORK/venv' && '$WORK/venv/bin/pip' install -q \
    torch==2.13.0 numpy pybind11 scikit-build-core pytest hypothesis gguf tokenizers jinja2 \
    safetensors tqdm" && PY=$WORK/venv/bin/python
fi
torch_cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('torch', 'pytest', 'hypothesis', 'gguf', 'tokenizers', 'jinja2')
               if u.find_spec(m) is None))" 2>/dev/null || echo "python")
pybind=$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)

# --- build: kernels, extension (with pybind11) and benchmarks (with Google Benchmark) ---
configure() {
  cmake -S "$ROOT" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DSPECINFER_BUILD_EXTENSION="$([ -n "$pybind" ] && echo ON || echo OFF)" \
    -Dpybind11_DIR="$pybind" -DPython_EXECUTABLE="$(command -v "$PY")" \
    -DCMAKE_PREFIX_PATH="$cmake_prefix" -DSPECINFER_BUILD_BENCHMARKS="$1" >"$WORK/configure.log" 2>&1 ||
    { tail -n 15 "$WORK/configure.log"; return 1; }
}
bench_built=1
if ! configure ON; then
  say "Google Benchmark not found (libbenchmark-dev, or its .deb files in $DEPS): no C++ benchmarks"
  bench_built=0
  configure OFF || no_gpu "cmake configure failed: see $WORK/configure.log"
fi
stage build 300 cmake --build "$WORK/build" -j"$(nproc)" || exit 1
if [ -n "$pybind" ]; then
  rm -rf "$WORK/pkg" && mkdir -p "$WORK/pkg" && cp -r "$ROOT/python/specinfer" "$WORK/pkg/"
  cp "$WORK/build"/_C*.so "$WORK/pkg/specinfer/"
fi

# --- Python: GPU tests and the SDPA comparison ---
python_ok=0
if [ -z "$pybind" ]; then
  say "skipping the Python stages: $PY has no pybind11, so no extension was built"
elif [ -n "$missing" ]; then
  say "skipping the Python stages: $PY lacks $missing (offline: wheels in $DEPS)"
elif [ "$torch_cuda" != 1 ]; then
  say "skipping the Python stages: torch $("$PY" -c 'import torch; print(torch.__version__)') has no CUDA (torch.cuda.is_available() is False); the C++ CUDA benchmarks still run"
else
  python_ok=1
  "$PY" -c "import specinfer._C as c; print('specinfer._C from', c.__file__, c.backends())"
  SPECINFER_EXPECT_CUDA=1 stage tests 240 "$PY" -m pytest -q -p no:cacheprovider --tb=short -m gpu \
    tests/test_ops.py tests/test_spec_ops.py tests/test_paged_ops.py tests/test_cuda_sampling.py \
    tests/test_speculative.py tests/test_offload.py
  if ((gpus > 1)); then # tensor parallelism over NCCL
    stage tensor_parallel 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_distributed.py
  else
    say "tensor_parallel: skipped, it needs 2 GPUs and this machine has $gpus"
  fi
fi

# --- benchmarks ---
if ((bench_built)); then
  stage cuda_bench 150 "$WORK/build/benchmarks/cpp/bench_kernels_cuda" \
    --benchmark_out="$OUT_DIR/bench_cuda.json" --benchmark_out_format=json >"$WORK/bench.log"
fi
if ((python_ok)); then
  stage sdpa 120 "$PY" benchmarks/bench_sdpa_gpu.py --out "$OUT_DIR/sdpa.json"
  # End to end on the GPU: decode (ours vs HF transformers) and offloading (resident vs
  # offload="cpu", pinned host memory, and "disk"). An offline machine cannot fetch the default
  # model: then a model of its shape with random weights (timings only; no SSM was trained for it).
  if "$PY" -c "import specinfer.default_model as d; raise SystemExit(d.local_model_path() is None)"; then
    model=() drafting=() have_model=1
  else
    say "the default model is not on this machine: timing one of its shape with random weights"
    "$PY" benchmarks/random_model.py --out "$WORK/random_model" >/dev/null 2>&1 &&
      model=(--model "$WORK/random_model") drafting=(--ssm layers:4+ngram) have_model=1
  fi
  if [ -n "${have_model:-}" ]; then
    stage decode 90 "$PY" benchmarks/bench_decode.py "${model[@]}" --device cuda --batch 1 16 \
      --tokens 32 --out "$OUT_DIR/decode.json"
    # The held-out prompts are made by make_prompts.py and not in git: stdlib docstrings travel.
    stage offload 120 "$PY" benchmarks/bench_offload.py "${model[@]}" "${drafting[@]}" \
      --device cuda --prompts 2 --tokens 32 --trees --prompts-file "" --out "$OUT_DIR/offload.json"
  else
    say "decode, offload: skipped, no default model and no transformers to make a random one"
    failed+=("decode" "offload")
  fi
fi
python3 benchmarks/gpu_check_summary.py --bench "$OUT_DIR/bench_cuda.json" \
  --sdpa "$OUT_DIR/sdpa.json" --out "$OUT_DIR/summary.json" || failed+=("microbenchmarks")

say "done in ${SECONDS}s; results in $OUT_DIR"
if ((${#failed[@]})); then
  say "failed: ${failed[*]}"
  exit 1
fi
