#!/usr/bin/env bash
# gpu-check.sh — build, test and benchmark flare's CUDA kernels on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh --out DIR [--arch 90a] [--build DIR] [--no-bench] [--no-python]
#                        [--no-tests] [--no-native-bench]
#
# --no-tests skips the C++ tests and sanitizers (steps 2 and 7), --no-native-bench the C++-side
# benchmarks (steps 3-5), so that one machine session can split the whole check into two calls.
#
# 1. configure (Ninja, Release, CUDA on, the given architecture: 90a for the H100) and build with
#    every core; 2. ctest -L gpu; 3. `flare bench --device cuda` (forward, backward, both) on the
#    standard grid and bench/torch_sdpa.py (PyTorch SDPA flash and cuDNN backends, same grid, same
#    card, same call) into DIR/flare.json and DIR/torch.json; 4. one side-by-side table
#    (bench/compare_table.py); 5. the same grid as packed batches (`flare bench --varlen`:
#    DIR/flare-varlen.json), the d 128 grid with softcap and ALiBi (DIR/flare-mods.json) and the
#    128k-token long-sequence run (DIR/long.json); 6. the Python
#    package's tests with torch on the GPU; then, unless --no-bench, through the Python package:
#    bench/compare.py (flare against SDPA's flash, cuDNN, efficient and math backends on the
#    standard grid: DIR/compare-<card>-<date>.json and -fwd/-bwd/-fwdbwd/-memory.png),
#    bench/model_shapes.py (flare vs SDPA cuDNN and flash on GPT-2/3, LLaMA-2/3, Phi-3 attention
#    shapes, fwd and bwd: DIR/model-shapes-<card>-<date>.json and .txt, the cells below 1.10x cuDNN),
#    bench/host_overhead.py (host and GPU time per call, eager and compiled: DIR/host_overhead.json;
#    again with the torch operators' Python kernels where their C++ ones were built:
#    DIR/host_overhead-python-kernels.json),
#    bench/decode_bench.py (KV-cache decoding against SDPA over the same cache: DIR/decode.json),
#    bench/block_sparse_bench.py (block-sparse time against density: DIR/block_sparse.json, .png)
#    and bench/gpt_loss.py (a small GPT trained with flare's attention and with SDPA's; fails unless
#    the loss curves agree within the spread between SDPA backends: DIR/gpt_loss-<card>-<date>
#    .json and .png); 7. training throughput, flare-train against bench/train_torch.py
#    (torch.compile + SDPA cuDNN) for GPT-2 124M, GPT-3 2.7B and LLaMA-3.2 1B (s 4096), with the
#    peer's per-kernel step profiles and DIR/train-<card>-<date>.json; 8. with two or more GPUs,
#    bench/ring_bench (ring, zigzag, all-to-all against one GPU; the context-parallel tests run
#    in step 2 on every visible GPU, and three more times there under lazy module loading),
#    then `flare bench-dist` one process per GPU under mpirun
#    (DIR/bench_dist_<N>gpu.json; with four or more, a 1M-token causal run) and once under a
#    torchrun-style environment; 9. ctest -L cpu. After the GPU tests, compute-sanitizer memcheck and
#    racecheck run on a small subset. Logs go to DIR. The Python benchmarks record the commit from
#    $FLARE_COMMIT when set (a copy of the tree without .git), else from git.
# Needs no network: GoogleTest is taken from the system, else built from a source tree given in
# GTEST_SRC (default: .deps/googletest, /usr/src/googletest); the Python stage needs nanobind and
# torch importable by python3, and matplotlib for the charts (without it: JSON only). Exit status:
# non-zero if the build, any test or any benchmark failed, gpt_loss.py's verdict included (the
# benchmarks still run after test failures, to see the numbers).
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines

out="" arch="90a" build="build-gpu" bench=1 python=1 tests=1 native_bench=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --no-python) python=0; shift ;;
    --no-tests) tests=0; shift ;;
    --no-native-bench) native_bench=0; shift ;;
    *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || { echo "usage: scripts/gpu-check.sh --out DIR [--arch 90a] [--build DIR] [--no-bench] [--no-python] [--no-tests] [--no-native-bench]" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
jobs="$(nproc)"
status=0
log() { echo "== $*" | tee -a "$out/summary.log"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  > "$out/nvidia-smi.log" 2>&1
log "$(tail -1 "$out/nvidia-smi.log")"

# GoogleTest: system package, or built once from source into the build tree.
gtest_args=()
if ! ls /usr/lib/x86_64-linux-gnu/libgtest.a /usr/lib64/libgtest.a /usr/local/lib/libgtest.a >/dev/null 2>&1; then
  src="${GTEST_SRC:-}"
  for cand in "$src" .deps/googletest /usr/src/googletest; do
    [[ -n "$cand" && -f "$cand/CMakeLists.txt" ]] && { src="$cand"; break; }
  done
  [[ -f "$src/CMakeLists.txt" ]] || { log "no GoogleTest found (set GTEST_SRC)"; exit 1; }
  cmake -S "$src" -B "$build/_gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
        -DCMAKE_INSTALL_PREFIX="$root/$build/_gtest/install" > "$out/gtest.log" 2>&1 &&
    cmake --build "$build/_gtest" -j "$jobs" >> "$out/gtest.log" 2>&1 &&
    cmake --install "$build/_gtest" >> "$out/gtest.log" 2>&1 || { log "GoogleTest build failed"; exit 1; }
  gtest_args=(-DGTest_ROOT="$root/$build/_gtest/install")
fi

log "configure + build (CUDA arch $arch, $jobs jobs)"
start=$(date +%s)
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLARE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" -DFLARE_PTXAS_VERBOSE=ON "${gtest_args[@]}" \
      > "$out/configure.log" 2>&1; then
  log "configure FAILED (configure.log)"; tail -20 "$out/configure.log"; exit 1
fi
if ! ninja -C "$build" -j "$jobs" > "$out/build.log" 2>&1; then
  log "build FAILED (build.log)"; grep -E "error|Error" "$out/build.log" | head -20; exit 1
fi
log "build ok in $(( $(date +%s) - start )) s; spills: $(grep -c 'bytes spill stores' "$out/build.log") reports, $(grep 'bytes spill stores' "$out/build.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads') nonzero"

run_ctest() {  # label
  log "ctest -L $1"
  if ctest --test-dir "$build" -L "$1" -j 8 --output-on-failure --timeout 900 \
       > "$out/ctest_$1.log" 2>&1; then
    log "ctest -L $1: $(grep -E 'tests passed' "$out/ctest_$1.log")"
  else
    status=1
    log "ctest -L $1 FAILED: $(grep -E 'tests passed|tests failed' "$out/ctest_$1.log")"
    grep -E "Failure|FAILED|exceeds|NaN|expected" "$out/ctest_$1.log" | head -40 | tee -a "$out/summary.log"
  fi
}

[[ $tests -eq 1 ]] && run_ctest gpu

# The context-parallel GPU suite again, three times, under CUDA's default lazy module loading
# (ctest sets CUDA_MODULE_LOADING=EAGER): its ranks are threads of one process, and a kernel's
# first launch then loads it, which may wait for the device while a peer's collective is in
# flight; no rank may hold its peer up meanwhile (docs/context-parallel.md). A run past the
# timeout is a hang and fails the stage.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [[ $tests -eq 1 && $gpus -ge 2 && -x "$build/tests/test_dist_gpu_attention" ]]; then
  for r in 1 2 3; do
    # Past the timeout, SIGUSR1 first: the test prints every thread's stack (the hang's cause).
    if timeout -s USR1 -k 15 240 env -u CUDA_MODULE_LOADING "$build/tests/test_dist_gpu_attention" \
         > "$out/dist_lazy_$r.log" 2>&1; then
      log "test_dist_gpu_attention, lazy loading, run $r: $(grep -E '^\[  PASSED' "$out/dist_lazy_$r.log")"
    else
      status=1
      log "test_dist_gpu_attention, lazy loading, run $r FAILED or hung at: $(grep -E '^\[ RUN' "$out/dist_lazy_$r.log" | tail -1)"
    fi
  done
fi

# compute-sanitizer on a small subset: memcheck (out-of-bounds, misaligned accesses) and racecheck
# (shared-memory hazards) over ragged shapes that exercise every boundary path of both kernels,
# sm80 and sm90, and their block-mask walks.
sanitize() {  # tool binary filter
  # A filter that matches no test would pass silently: ask for at least one test run.
  if timeout 150 compute-sanitizer --tool "$1" --error-exitcode 9 "$build/tests/$2" --gtest_filter="$3" \
       > "$out/sanitizer_$1_$2.log" 2>&1 &&
     grep -qE '^\[  PASSED  \] [1-9][0-9]* test' "$out/sanitizer_$1_$2.log"; then
    log "compute-sanitizer $1 $2 ($3): clean"
  else
    status=1
    log "compute-sanitizer $1 $2 ($3) FAILED"
    grep -E "ERROR SUMMARY|Invalid|Race|hazard" "$out/sanitizer_$1_$2.log" | head -10 | tee -a "$out/summary.log"
  fi
}
if [[ $tests -eq 0 ]]; then
  :
elif command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    sanitize "$tool" test_gpu_forward '*SmallestHeadDimRaggedLengths/bf16_d64:*SmallestHeadDimRaggedLengths/bf16_d256:*VarlenWithEmptySequences/bf16:GpuForwardSm90.RaggedShapesSmall'
    sanitize "$tool" test_gpu_backward 'GpuBackward.SeqlenMismatchAndFullyMaskedRows:GpuBackward.VarlenWithEmptySequences:GpuBackward.Sm90RaggedShapesSmall'
    sanitize "$tool" test_gpu_nonfinite '*GpuNonfiniteExamples*:Masks/GpuNonfiniteSm90.AllInjections/Causal_bf16_d128'
    sanitize "$tool" test_gpu_block_sparse 'GpuBlockSparse.SmallRaggedShapes:*GpuBlockSparseUnseen.NanAndInfInOffBlocksNeverArrive/d128_s640'
  done
else
  log "compute-sanitizer not found: sanitizer checks skipped"
fi

if [[ $bench -eq 1 && $native_bench -eq 1 ]]; then
  log "flare bench --device cuda (fwd, bwd, fwdbwd)"
  "$build/apps/flare/flare" bench --device cuda --pass all --json "$out/flare.json" \
    > "$out/bench_flare.log" 2>&1 || { status=1; log "flare bench FAILED"; tail -20 "$out/bench_flare.log"; }
  log "torch SDPA (flash, cuDNN) (fwd, bwd, fwdbwd)"
  PYTHONUNBUFFERED=1 python3 bench/torch_sdpa.py --pass all --json "$out/torch.json" \
    > "$out/bench_torch.log" 2>&1 || { status=1; log "torch_sdpa.py FAILED"; tail -20 "$out/bench_torch.log"; }
  if [[ -f "$out/flare.json" && -f "$out/torch.json" ]]; then
    python3 bench/compare_table.py "$out/flare.json" "$out/torch.json" | tee "$out/compare.txt"
  fi
  # Packed batches: the standard grid's batches as sequences of 0.25-1.75 s (flare bench --varlen).
  log "flare bench --device cuda --varlen (fwd, bwd)"
  "$build/apps/flare/flare" bench --device cuda --varlen --pass all --json "$out/flare-varlen.json" \
    > "$out/bench_flare_varlen.log" 2>&1 ||
    { status=1; log "flare bench --varlen FAILED"; tail -20 "$out/bench_flare_varlen.log"; }
  # Score modifiers (softcap 30 and ALiBi) at d 128: the kernels' modified path, whichever runs it.
  log "flare bench --device cuda --softcap 30 --alibi --d 128 (fwd, bwd)"
  "$build/apps/flare/flare" bench --device cuda --softcap 30 --alibi --d 128 --pass all \
    --json "$out/flare-mods.json" > "$out/bench_flare_mods.log" 2>&1 ||
    { status=1; log "flare bench --softcap --alibi FAILED"; tail -20 "$out/bench_flare_mods.log"; }
  # Long sequences: no O(s^2) buffer anywhere, so 128k tokens fit; peak memory is recorded.
  log "long sequence: b=1 s=131072 h=16 d=128 bf16 causal, fwd+bwd"
  "$build/apps/flare/flare" bench --device cuda --b 1 --s 131072 --h 16 --d 128 --causal \
    --pass all --warmup 1 --iters 3 --json "$out/long.json" 2>&1 | tee -a "$out/summary.log" ||
    { status=1; log "long-sequence bench FAILED"; }
fi

# The Python package on the GPU: torch autograd, torch.compile and CUDA streams through flare.
if [[ $python -eq 1 ]]; then
  log "python: build the extension and run tests/python"
  py_built=0
  if cmake -S . -B "$build-py" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLARE_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$arch" -DFLARE_BUILD_TESTS=OFF -DFLARE_BUILD_APPS=OFF \
        -DFLARE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" > "$out/python.log" 2>&1 &&
     ninja -C "$build-py" -j "$jobs" >> "$out/python.log" 2>&1; then
    py_built=1
    if PYTHONPATH="$root/$build-py/python" python3 -m pytest tests/python -q -ra -p no:cacheprovider \
         >> "$out/python.log" 2>&1; then
      log "python: $(tail -1 "$out/python.log")"
    else
      status=1; log "python tests FAILED: $(tail -1 "$out/python.log")"
      grep -E "FAILED|Error" "$out/python.log" | head -20 | tee -a "$out/summary.log"
    fi
  else
    status=1; log "python build FAILED (python.log)"; tail -20 "$out/python.log"
  fi

  # Through the Python package: flare against every SDPA backend on the standard grid (JSON and
  # charts), and a small GPT trained with flare's attention against SDPA's (loss curves).
  if [[ $bench -eq 1 && $py_built -eq 1 ]]; then
    log "bench/compare.py: flare vs SDPA flash, cuDNN, efficient, math (fwd, bwd, fwdbwd)"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/compare.py \
         --out "$out" --warmup 3 --iters 10 > "$out/bench_compare.log" 2>&1; then
      grep -E '^# |^wrote ' "$out/bench_compare.log" | tee -a "$out/summary.log"
    else
      status=1; log "compare.py FAILED (bench_compare.log)"
      tail -20 "$out/bench_compare.log" | tee -a "$out/summary.log"
    fi
    log "bench/model_shapes.py: flare vs SDPA cuDNN, flash on model attention shapes (fwd, bwd)"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/model_shapes.py \
         --out "$out" --warmup 3 --iters 10 > "$out/model_shapes.log" 2>&1; then
      # The summary from the table file: in the log, SDPA's warnings also have indented lines.
      table="$(sed -n 's/^wrote \(.*\.txt\)$/\1/p' "$out/model_shapes.log")"
      { grep -E '^(fwd|bwd): |^  ' "$table"; grep -E '^wrote ' "$out/model_shapes.log"; } |
        tee -a "$out/summary.log"
    else
      status=1; log "model_shapes.py FAILED (model_shapes.log)"
      tail -20 "$out/model_shapes.log" | tee -a "$out/summary.log"
    fi
    log "bench/host_overhead.py: host vs GPU time per call, flare vs SDPA cuDNN/flash, eager and compiled"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/host_overhead.py \
         --json "$out/host_overhead.json" --compile > "$out/host_overhead.log" 2>&1; then
      log "host_overhead.json written"
    else
      status=1; log "host_overhead.py FAILED (host_overhead.log)"; tail -20 "$out/host_overhead.log"
    fi
    # The same with torch.ops.flare's Python kernels, where the C++ ones were built: the A/B of
    # flare/_torch_ops.so on the compiled road.
    if [[ -e "$build-py/python/flare/_torch_ops.so" ]]; then
      log "bench/host_overhead.py again with FLARE_TORCH_OPS=python (the operators' Python kernels)"
      if FLARE_TORCH_OPS=python PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 \
           bench/host_overhead.py --json "$out/host_overhead-python-kernels.json" --compile \
           > "$out/host_overhead-python-kernels.log" 2>&1; then
        log "host_overhead-python-kernels.json written"
      else
        status=1; log "host_overhead.py (Python kernels) FAILED (host_overhead-python-kernels.log)"
      fi
    else
      log "no flare/_torch_ops.so in $build-py (python.log says why): the operators run Python kernels"
    fi
    log "bench/decode_bench.py: KV-cache decoding (contiguous and paged) vs SDPA over the same cache"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/decode_bench.py \
         --json "$out/decode.json" > "$out/decode.log" 2>&1; then
      tail -1 "$out/decode.log" | tee -a "$out/summary.log"
    else
      status=1; log "decode_bench.py FAILED (decode.log)"; tail -20 "$out/decode.log"
    fi
    log "bench/block_sparse_bench.py: block-sparse time against the mask's density (s 16k, 64k)"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/block_sparse_bench.py \
         --long --out "$out/block_sparse.json" > "$out/block_sparse.log" 2>&1; then
      tail -1 "$out/block_sparse.log" | tee -a "$out/summary.log"
      python3 bench/plot_block_sparse.py --out "$out/block_sparse.png" "$out/block_sparse.json" ||
        log "plot_block_sparse.py failed (the JSON is kept)"
    else
      status=1; log "block_sparse_bench.py FAILED (block_sparse.log)"; tail -20 "$out/block_sparse.log"
    fi
    log "bench/gpt_loss.py: GPT loss curves, flare vs SDPA (flash reference; efficient, cuDNN)"
    if PYTHONUNBUFFERED=1 PYTHONPATH="$root/$build-py/python" python3 bench/gpt_loss.py \
         --out "$out" > "$out/gpt_loss.log" 2>&1; then
      grep -E '^# (pass|FAIL) (context|curve|final)|^# gpt_loss|^wrote ' "$out/gpt_loss.log" |
        tee -a "$out/summary.log"
    else
      status=1; log "gpt_loss.py FAILED (gpt_loss.log)"
      { grep -E '^# (FAIL|gpt_loss)' "$out/gpt_loss.log" || tail -20 "$out/gpt_loss.log"; } |
        tee -a "$out/summary.log"
    fi
  fi
fi
# Training: flare-train against the PyTorch reference (torch.compile + SDPA cuDNN), same card,
# same call, random tokens (bench/results/*/train*.json; docs/training.md).
if [[ $bench -eq 1 && $native_bench -eq 1 && -x "$build/apps/train/flare-train" ]]; then
  log "training throughput: flare-train vs bench/train_torch.py (GPT-2 124M b16, GPT-3 2.7B b4 s 1024, LLaMA-3.2 1B b4 s 4096)"
  ft="$build/apps/train/flare-train"
  "$ft" synth-data --out "$out/synth" > "$out/train_synth.log" 2>&1 || { status=1; log "synth-data FAILED"; }
  flare_rows=()
  # bf16 gradients: each weight gradient rounded once to bf16, as the peer's autocast products
  # round theirs (the row's "gradients" field says so).
  for c in "gpt2 16 1024 40" "gpt3-2.7b 4 1024 30" "llama3.2-1b 4 4096 15"; do
    set -- $c
    if "$ft" --model "$1" --data "$out/synth" --batch "$2" --seq "$3" --steps "$4" --warmup 5 \
         --bf16-grads --sample 0 --no-checkpoint --nondeterministic --log "$out/train_$1.jsonl" > "$out/train_$1.log" 2>&1; then
      log "flare-train $1: $(grep '^throughput' "$out/train_$1.log")"
      flare_rows+=(--flare "$1:$2:$3:$out/train_$1.log:$out/train_$1.jsonl")
    else
      status=1; log "flare-train $1 FAILED"; tail -5 "$out/train_$1.log" | tee -a "$out/summary.log"
    fi
  done
  rm -rf "$out/synth"
  # The peer, and its per-kernel step profile (kernel-profile-torch-compile-<model>.txt) to lay
  # beside flare-train's (docs/training.md: ncu or nsys).
  if PYTHONUNBUFFERED=1 python3 bench/train_torch.py --case gpt2:16:1024 --case gpt3-2.7b:4:1024 \
       --case llama3.2-1b:4:4096 --vocab 50257 --out "$out/torch" --kernel-profile "$out" \
       > "$out/train_torch.log" 2>&1; then
    grep -E 'tokens/s' "$out/train_torch.log" | tee -a "$out/summary.log"
  else
    status=1; log "train_torch.py FAILED"; tail -5 "$out/train_torch.log" | tee -a "$out/summary.log"
  fi
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  python3 bench/train_results.py --out "$out" "${flare_rows[@]}" \
    $(ls "$out"/torch/train_torch-*.json 2>/dev/null | sed 's/^/--torch /') --card "$card" \
    > "$out/train_results.log" 2>&1 || { status=1; log "train_results.py FAILED"; }
  tail -4 "$out/train_results.log" | tee -a "$out/summary.log"
fi

# Several GPUs: the context-parallel tests ran in ctest -L gpu above (they use every visible GPU);
# here ring/zigzag/all-to-all are timed against one GPU in the same process. NVLink multicast
# (NVLS) stays off.
if [[ $bench -eq 1 && $native_bench -eq 1 && $gpus -ge 2 && -x "$build/ring_bench" ]]; then
  log "ring_bench on $gpus GPUs (ring, zigzag, all-to-all vs one GPU)"
  NCCL_NVLS_ENABLE=0 "$build/ring_bench" --gpus "$gpus" --s 32768,131072 \
    --strategies ring,zigzag,a2a --json "$out/ring_bench.json" > "$out/ring_bench.log" 2>&1 ||
    { status=1; log "ring_bench FAILED"; }
  tail -14 "$out/ring_bench.log" | tee -a "$out/summary.log"
fi

# Several GPUs, one process per GPU as users launch it: flare bench-dist under mpirun (ring,
# zigzag, all-to-all against rank 0's single-GPU run; a 1M-token causal fwd+bwd without the
# single-GPU run) and once under a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR/PORT set by hand, so torchrun itself is not needed).
mpi=(mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -x FLARE_COMMIT)
if [[ $bench -eq 1 && $native_bench -eq 1 && $gpus -ge 2 && -x "$build/apps/flare/flare" ]] &&
   command -v mpirun > /dev/null; then
  log "flare bench-dist under mpirun -np $gpus (ring, zigzag, a2a; 32k-512k tokens, causal)"
  if timeout 900 "${mpi[@]}" -np "$gpus" "$build/apps/flare/flare" bench-dist \
       --s 32768,131072,524288 --strategies ring,zigzag,a2a \
       --json "$out/bench_dist_${gpus}gpu.json" > "$out/bench_dist.log" 2>&1; then
    grep -E '^(impl|flare-)' "$out/bench_dist.log" | tee -a "$out/summary.log"
  else
    status=1; log "bench-dist (mpirun) FAILED"; tail -10 "$out/bench_dist.log" | tee -a "$out/summary.log"
  fi
  if [[ $gpus -ge 4 ]]; then
    log "flare bench-dist: 1M tokens causal (b 1, h 32/8, d 128) on $gpus GPUs"
    timeout 600 "${mpi[@]}" -np "$gpus" "$build/apps/flare/flare" bench-dist --s 1048576 \
      --strategies zigzag --no-single --warmup 0 --iters 1 \
      --json "$out/bench_dist_1m_${gpus}gpu.json" > "$out/bench_dist_1m.log" 2>&1 ||
      { status=1; log "bench-dist 1M FAILED"; }
    tail -4 "$out/bench_dist_1m.log" | tee -a "$out/summary.log"
  fi
  ls "$out"/bench_dist_*gpu.json > /dev/null 2>&1 && python3 bench/plot_dist.py \
    --out "$out/bench_dist_efficiency.png" "$out"/bench_dist_*gpu.json >> "$out/bench_dist.log" 2>&1
  log "flare bench-dist under a torchrun-style environment ($gpus processes)"
  pids=()
  for ((r = 0; r < gpus; r++)); do
    RANK=$r WORLD_SIZE=$gpus LOCAL_RANK=$r LOCAL_WORLD_SIZE=$gpus MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=29533 NCCL_NVLS_ENABLE=0 timeout 300 "$build/apps/flare/flare" bench-dist \
      --s 32768 --strategies zigzag --warmup 1 --iters 3 > "$out/bench_dist_env_$r.log" 2>&1 &
    pids+=($!)
  done
  env_ok=1
  for p in "${pids[@]}"; do wait "$p" || env_ok=0; done
  if [[ $env_ok -eq 1 ]]; then
    log "torchrun-style launch: $(grep -E '^flare-zigzag' "$out/bench_dist_env_0.log" | head -1)"
  else
    status=1; log "torchrun-style launch FAILED"; tail -5 "$out"/bench_dist_env_*.log | tee -a "$out/summary.log"
  fi
fi

# Data-parallel training on every GPU: the launch smoke test (mpirun and torchrun-style), then
# GPT-3 2.7B (batch 4 x 1024 per GPU) on one GPU and on all of them under mpirun, for the scaling
# efficiency (tokens/s on N GPUs / (N x tokens/s on one)), LLaMA-2 7B on four or more (ZeRO-1 at
# batch 1, ZeRO-2 at batch 4), and the
# PyTorch peer on all of them (bench/train_torch.py under torchrun: DDP + torch.compile + SDPA
# cuDNN); bench/train_results.py merges them into DIR/train-<card>-<date>.json.
ft="$build/apps/train/flare-train"
if [[ $bench -eq 1 && $native_bench -eq 1 && $gpus -ge 2 && -x "$ft" ]] && command -v mpirun > /dev/null; then
  log "data-parallel training: scripts/dp-smoke.sh on $gpus GPUs"
  scripts/dp-smoke.sh --build "$build" --out "$out/dp_smoke" --gpus "$gpus" > /dev/null 2>&1 ||
    status=1
  cat "$out/dp_smoke/dp_smoke.log" 2>/dev/null | tail -8 | tee -a "$out/summary.log"
  log "data-parallel training: GPT-3 2.7B b4 s1024 on 1 and $gpus GPUs, LLaMA-2 7B on $gpus (mpirun)"
  "$ft" synth-data --out "$out/synth" > /dev/null 2>&1
  "$ft" synth-data --vocab 32000 --out "$out/synth32k" > /dev/null 2>&1  # LLaMA-2's vocabulary
  dp_rows=()
  dp_run() {  # name ranks data model batch seq [flags]
    timeout 600 "${mpi[@]}" -np "$2" "$ft" --model "$4" --data "$3" --batch "$5" --seq "$6" \
      --steps 30 --warmup 5 --sample 0 --no-checkpoint --nondeterministic "${@:7}" \
      --log "$out/train_dp_$1.jsonl" > "$out/train_dp_$1.log" 2>&1 ||
      { status=1; log "flare-train $1 FAILED"; tail -5 "$out/train_dp_$1.log"; }
    log "flare-train $1: $(grep -E '^throughput' "$out/train_dp_$1.log")"
    dp_rows+=(--flare "$4:$5:$6:$out/train_dp_$1.log:$out/train_dp_$1.jsonl")
  }
  dp_run gpt3_1gpu 1 "$out/synth" gpt3-2.7b 4 1024
  dp_run "gpt3_${gpus}gpu" "$gpus" "$out/synth" gpt3-2.7b 4 1024
  [[ $gpus -ge 4 ]] && dp_run "llama2_7b_${gpus}gpu" "$gpus" "$out/synth32k" llama2-7b 1 1024
  # ZeRO-2: the gradient sharded too, which leaves room for 4 sequences per GPU.
  [[ $gpus -ge 4 ]] && dp_run "llama2_7b_b4_zero2_${gpus}gpu" "$gpus" "$out/synth32k" llama2-7b 4 1024 --zero 2
  # Context parallel: one 64k-token sequence across every GPU.
  dp_run "llama1b_s64k_cp${gpus}" "$gpus" "$out/synth" llama3.2-1b 1 65536 --cp "$gpus" --recompute
  PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 timeout 600 torchrun --standalone --nproc-per-node "$gpus" bench/train_torch.py \
    --case gpt3-2.7b:4:1024 --vocab 50257 --out "$out/torch_ddp" > "$out/train_torch_ddp.log" 2>&1 ||
    { status=1; log "train_torch.py under torchrun FAILED"; tail -5 "$out/train_torch_ddp.log"; }
  log "torch DDP gpt3-2.7b x$gpus: $(grep -E 'tokens/s' "$out/train_torch_ddp.log")"
  # One result file: flare's rows, the peer's, flare over the peer and the 1 -> N scaling.
  python3 bench/train_results.py --out "$out" --card "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    "${dp_rows[@]}" $(ls "$out"/torch_ddp/train_torch-*.json 2>/dev/null | sed 's/^/--torch /') \
    2>&1 | tee -a "$out/summary.log"
  rm -rf "$out/synth" "$out/synth32k"
fi

[[ $tests -eq 1 ]] && run_ctest cpu
log "done (status $status)"
exit $status
