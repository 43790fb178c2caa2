#!/usr/bin/env bash
# train-ab.sh — A/B of flare-train's step time between source trees (or settings), in one call.
#
#   scripts/train-ab.sh --out DIR [--model gpt3-2.7b] [--batch 4] [--seq 1024] [--steps 25]
#                       [--rounds 2] [--vocab 50257] [--device cuda] [--arch 90a]
#                       NAME=SOURCE_DIR[,VAR=VALUE|,--flag...] [NAME=SOURCE_DIR[,...] ...]
#
# The first NAME is the base. Each SOURCE_DIR is a whole source tree (`.` for the working tree;
# another commit as `git archive REF | tar -x -C DIR`, made before the call, since .git does not
# travel to the device); VAR=VALUE pairs are set in the environment of that variant's runs only,
# and --flag items (no spaces) are added to its flare-train command line, so one tree can be
# compared with itself under other settings (e.g. bf16=.,--bf16-grads). Each distinct tree is built once
# (Release, flare_train_app, in build-trainab/<n>; CUDA for --device cuda), then every variant
# trains the same synthetic tokens (`flare-train synth-data`, ids below --vocab, which must not
# exceed the model's vocabulary: 300 for the tiny test presets) for --steps steps, variants
# alternating within each of --rounds rounds so that drift of clocks and temperature spreads over
# all of them. flare-train's own summary line (the median step of the steady state) is the
# measure. DIR receives each run's log and train-ab.txt: every run's line, then per variant the
# mean step time over the rounds and base / variant (> 1: the variant is faster).
# It does not test the variants: run the trainer's GPU tests (scripts/gpu-check.sh) on the one
# you keep.
set -uo pipefail

out="" model="gpt3-2.7b" batch=4 seq=1024 steps=25 rounds=2 vocab=50257 device="cuda" arch="90a"
variants=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --vocab) vocab="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    *=*) variants+=("$1"); shift ;;
    *) echo "train-ab.sh: unknown argument '$1' (see the header for usage)" >&2; exit 2 ;;
  esac
done
if [[ -z "$out" || ${#variants[@]} -lt 2 ]]; then
  echo "train-ab.sh: --out DIR and at least two NAME=SOURCE_DIR are required" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 1
root=$PWD
mkdir -p "$out/logs"
out=$(cd "$out" && pwd)
cuda=ON
[[ "$device" == cuda ]] || cuda=OFF

# Variant i: its name, its tree (absolute), its environment; trees[] holds each distinct tree once.
names=() srcs=() envs=() flags=() trees=()
for v in "${variants[@]}"; do
  name=${v%%=*} rest=${v#*=}
  dir=${rest%%,*} env="" flag=""
  if [[ "$rest" == *,* ]]; then
    IFS=, read -ra items <<< "${rest#*,}"
    for item in "${items[@]}"; do
      if [[ "$item" == --* ]]; then flag+=" $item"; else env+=" $item"; fi
    done
  fi
  [[ -d "$dir" ]] || { echo "train-ab.sh: $dir is not a folder" >&2; exit 2; }
  dir=$(cd "$dir" && pwd)
  names+=("$name") srcs+=("$dir") envs+=("$env") flags+=("$flag")
  [[ " ${trees[*]} " == *" $dir "* ]] || trees+=("$dir")
done

binary() {  # tree → its flare-train
  local i
  for i in "${!trees[@]}"; do
    [[ "${trees[$i]}" == "$1" ]] && { echo "$root/build-trainab/$i/apps/train/flare-train"; return; }
  done
}
for i in "${!trees[@]}"; do
  b=$root/build-trainab/$i
  if ! { cmake -S "${trees[$i]}" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLARE_CUDA=$cuda \
           -DCMAKE_CUDA_ARCHITECTURES="$arch" -DFLARE_BUILD_TESTS=OFF > "$out/logs/cmake_$i.log" 2>&1 &&
         ninja -C "$b" -j "$(nproc)" flare_train_app > "$out/logs/build_$i.log" 2>&1; }; then
    grep -E "error" "$out/logs/build_$i.log" "$out/logs/cmake_$i.log" | head -20
    echo "train-ab.sh: ${trees[$i]} does not build" >&2
    exit 1
  fi
  echo "built ${trees[$i]}"
done

data=$out/synth
"$(binary "${srcs[0]}")" synth-data --out "$data" --vocab "$vocab" > "$out/logs/synth.log" 2>&1 ||
  { tail -5 "$out/logs/synth.log"; echo "train-ab.sh: synth-data failed" >&2; exit 1; }
for r in $(seq 1 "$rounds"); do
  for i in "${!names[@]}"; do
    log=$out/logs/${names[$i]}_round$r.log
    env ${envs[$i]} "$(binary "${srcs[$i]}")" --model "$model" --device "$device" --data "$data" \
      --batch "$batch" --seq "$seq" --steps "$steps" --warmup 5 --sample 0 --no-checkpoint \
      --nondeterministic --eval-every 0 ${flags[$i]} > "$log" 2>&1 ||
      echo "train-ab.sh: ${names[$i]} failed in round $r (see $log)" >&2
  done
done
rm -rf "$data"

python3 - "$out" "$model" "$batch" "$seq" "$rounds" "${names[@]}" <<'PY' | tee "$out/train-ab.txt"
import os, re, statistics, sys

out, model, batch, seq, rounds, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:]
step = re.compile(r"^throughput: .*?([0-9.]+) ms/step")
print(f"flare-train {model} b{batch} s{seq}; ms/step is flare-train's median steady-state step; "
      f"ratio = base / variant (> 1: faster than the base '{names[0]}')")
times = {n: [] for n in names}
for r in range(1, rounds + 1):
    for n in names:
        lines = open(os.path.join(out, "logs", f"{n}_round{r}.log")).read().splitlines()
        summary = [l for l in lines if l.startswith(("throughput:", "profile of that step"))]
        for l in summary:
            m = step.match(l)
            if m:
                times[n].append(float(m.group(1)))
        print(f"round {r} {n:>12}: " + (" | ".join(summary) if summary else "no summary line (failed)"))
base = statistics.mean(times[names[0]]) if times[names[0]] else None
for n in names:
    if not times[n]:
        print(f"{n:>12}: no steady-state time")
        continue
    mean = statistics.mean(times[n])
    ratio = f"  x{base / mean:.3f}" if base else ""
    print(f"{n:>12}: {mean:8.2f} ms/step over {len(times[n])} rounds{ratio}")
PY
