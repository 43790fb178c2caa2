#!/usr/bin/env bash
# dp-smoke.sh — data-parallel training launched as users launch it, on the GPUs of this machine:
# flare-train under mpirun, then under a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT set by hand for background processes, so torchrun itself is not
# needed), a few steps of a small model on random tokens each.
#
#   scripts/dp-smoke.sh --build DIR --out DIR [--gpus N] [--model gpt-tiny] [--steps 5]
#
# Checks, for each launch: every rank exits 0; each step's line appears exactly once (rank 0
# prints, the others do not); the JSON log has one line per step with the step profile
# (comm_ms, comm_exposed_ms). Also that a partial launch environment is refused with exit 2 before
# any rendezvous. Logs go to DIR. Exit status 0 when every check passed, 1 otherwise, 2 on bad
# arguments; without two GPUs (or mpirun, for that part) it says so and skips.
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines

build="" out="" gpus="" model="gpt-tiny" steps=5
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "dp-smoke.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -n "$build" && -n "$out" ]] ||
  { echo "usage: scripts/dp-smoke.sh --build DIR --out DIR [--gpus N] [--model NAME] [--steps N]" >&2; exit 2; }
bin="$(cd "$build" && pwd)/apps/train/flare-train"
[[ -x "$bin" ]] || { echo "dp-smoke.sh: $bin is not built (target flare_train_app)" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log() { echo "== dp-smoke: $*" | tee -a "$out/dp_smoke.log"; }

if [[ -z "$gpus" ]]; then
  gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | wc -l)"
fi
if [[ "$gpus" -lt 2 ]]; then
  log "skipped: needs 2 GPUs, found $gpus"
  exit 0
fi
status=0

# Random tokens: the loss stays near log(vocab), which is all a launch check needs.
data="$out/dp_smoke_data"
"$bin" synth-data --out "$data" --tokens 262144 --vocab 300 > "$out/dp_smoke_synth.log" 2>&1 ||
  { log "synth-data FAILED"; cat "$out/dp_smoke_synth.log"; exit 1; }
train_args=(train --model "$model" --data "$data" --batch 4 --seq 64 --grad-accum 2 --steps "$steps"
            --warmup 1 --eval-every 0 --no-checkpoint --sample 0 --dp-timeout-ms 120000)

# Every rank exited 0 ($1: "ok" or not), each step line once in $2, $steps JSON lines in $3.
check_run() {
  local what="$1" ok="$2" text="$3" json="$4"
  if [[ "$ok" != ok ]]; then
    status=1; log "$what: a rank FAILED"; return
  fi
  local s lines
  for ((s = 1; s <= steps; s++)); do
    lines="$(grep -cE "^step +$s/$steps \|" "$text")"
    if [[ "$lines" -ne 1 ]]; then
      status=1; log "$what: step $s printed $lines times (want 1: rank 0 only)"
    fi
  done
  lines="$(grep -c '"comm_exposed_ms"' "$json" 2> /dev/null)"
  if [[ "$lines" -ne "$steps" ]]; then
    status=1; log "$what: $json has $lines step lines with the profile, want $steps"
  fi
  log "$what: $(grep -E "^step +$steps/" "$text" | head -1)"
  grep -E '^(throughput|profile)' "$text" | tee -a "$out/dp_smoke.log"
}

# 1. mpirun: one process per GPU, OMPI_COMM_WORLD_* tell each its place.
if command -v mpirun > /dev/null; then
  log "mpirun -np $gpus flare-train ${train_args[*]}"
  rm -f "$out/dp_smoke_mpirun.jsonl"
  if timeout 600 mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE=0 -np "$gpus" \
       "$bin" "${train_args[@]}" --log "$out/dp_smoke_mpirun.jsonl" > "$out/dp_smoke_mpirun.log" 2>&1; then
    check_run "mpirun" ok "$out/dp_smoke_mpirun.log" "$out/dp_smoke_mpirun.jsonl"
  else
    check_run "mpirun" failed "$out/dp_smoke_mpirun.log" "$out/dp_smoke_mpirun.jsonl"
    tail -20 "$out/dp_smoke_mpirun.log" | tee -a "$out/dp_smoke.log"
  fi
else
  log "mpirun not found: the mpirun launch is skipped"
fi

# 2. torchrun style: background processes with the variables set by hand; rank 0's output is the
#    run's, every rank's exit status counts.
log "torchrun-style environment, $gpus processes"
rm -f "$out/dp_smoke_env.jsonl"
pids=()
for ((r = 0; r < gpus; r++)); do
  RANK=$r WORLD_SIZE=$gpus LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=29541 \
    timeout 600 "$bin" "${train_args[@]}" --log "$out/dp_smoke_env.jsonl" > "$out/dp_smoke_env_$r.log" 2>&1 &
  pids+=($!)
done
env_ok=ok
for p in "${pids[@]}"; do wait "$p" || env_ok=failed; done
cat "$out"/dp_smoke_env_*.log > "$out/dp_smoke_env.log"
check_run "torchrun-style" "$env_ok" "$out/dp_smoke_env.log" "$out/dp_smoke_env.jsonl"
[[ "$env_ok" == ok ]] || tail -5 "$out"/dp_smoke_env_*.log | tee -a "$out/dp_smoke.log"

# 3. A partial launch environment is a usage error before any rendezvous (nothing waits).
RANK=1 timeout 60 "$bin" "${train_args[@]}" > "$out/dp_smoke_partial.log" 2>&1
code=$?
if [[ $code -eq 2 ]] && grep -q "launch environment" "$out/dp_smoke_partial.log"; then
  log "partial launch environment refused: $(head -1 "$out/dp_smoke_partial.log")"
else
  status=1; log "partial launch environment: exit $code, want 2 with a message"; cat "$out/dp_smoke_partial.log"
fi

log "done (status $status)"
exit $status
