#!/usr/bin/env bash
# ab-bench.sh — A/B timing of kernel variants against the working tree, on one GPU, in one call.
#
#   scripts/ab-bench.sh --out DIR [--pass bwd] [--d "64 128 256"] [--runs 2] [--arch 90a]
#                       NAME=OVERLAY_DIR [NAME=OVERLAY_DIR ...]
#
# The base is the working tree as it is. A variant is a folder of files at their repository
# paths (e.g. OVERLAY_DIR/src/cuda/sm80/bwd_kernel.cuh) that replace the tree's for that variant's
# build only. Everything is built from a copy of the tree (build-ab/src, made afresh each run),
# never from the tree itself, so builds and tests running beside the A/B (on another GPU of the
# host) see only the tree's own files: laid over the tree, the variants had ended up in such
# builds. Every variant is built in one build folder (build-ab/obj; only what the overlay
# touches recompiles) and its `flare` binary kept. Then `flare bench --device cuda` runs the
# standard grid for each (pass, head dim), alternating base and variants run by run so slow drift of clocks and
# temperature spreads over all of them. DIR receives each run's JSON, the build logs, and
# ab.txt: per cell the base's TFLOP/s and each variant's, with the ratio of their means, and per
# variant the median, minimum and maximum ratio over the cells.
#
# The A/B numbers in src/cuda/sm80/*_notes.md and the commit messages were taken this way.
# It does not test the variants: run scripts/gpu-check.sh on the one you keep.
set -uo pipefail

out="" pass="bwd" dims="64 128 256" runs=2 arch="90a"
variants=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --pass) pass="$2"; shift 2 ;;
    --d) dims="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    *=*) variants+=("$1"); shift ;;
    *) echo "ab-bench.sh: unknown argument '$1' (see the header for usage)" >&2; exit 2 ;;
  esac
done
if [[ -z "$out" || ${#variants[@]} -eq 0 ]]; then
  echo "ab-bench.sh: --out DIR and at least one NAME=OVERLAY_DIR are required" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 1
root=$PWD
mkdir -p "$out/json" "$out/bin"
out=$(cd "$out" && pwd)
for i in "${!variants[@]}"; do  # overlay folders as absolute paths
  dir=${variants[$i]#*=}
  [[ -d "$dir" ]] || { echo "ab-bench.sh: $dir is not a folder" >&2; exit 2; }
  variants[$i]="${variants[$i]%%=*}=$(cd "$dir" && pwd)"
done
build=$root/build-ab/obj
src=$root/build-ab/src
jobs=$(nproc)
# The copy: tracked and untracked files, not the build folders or .git; fresh modification
# times, so that the base rebuilds whatever an earlier run's variant left compiled.
rm -rf "$src" && mkdir -p "$src" &&
  tar -C "$root" --exclude='./build*' --exclude='./.git' -cf - . | tar -C "$src" -xmf - ||
  { echo "ab-bench.sh: cannot copy the tree to $src" >&2; exit 1; }
cd "$src" || exit 1

saved=$(mktemp -d)
overlaid=()
restore() {
  for f in "${overlaid[@]}"; do cp "$saved/$f" "$f"; done
  overlaid=()
}
trap 'restore; rm -rf "$saved"' EXIT

cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLARE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" -DFLARE_BUILD_TESTS=OFF > "$out/cmake.log" 2>&1 ||
  { tail -20 "$out/cmake.log"; exit 1; }

names=(base)
build_one() {  # name
  if ! ninja -C "$build" -j "$jobs" flare_cli > "$out/build_$1.log" 2>&1; then
    grep -E "error" "$out/build_$1.log" | head -20
    echo "ab-bench.sh: $1 does not build" >&2
    exit 1
  fi
  echo "$1: built; ptxas spill warnings: $(grep -c 'spilled' "$out/build_$1.log")"
  cp "$build/apps/flare/flare" "$out/bin/$1"
}
build_one base
for v in "${variants[@]}"; do
  name=${v%%=*} dir=${v#*=}
  while IFS= read -r f; do
    f=${f#./}
    [[ -f "$f" ]] || { echo "ab-bench.sh: $dir/$f replaces no file of the tree" >&2; exit 2; }
    mkdir -p "$saved/$(dirname "$f")"
    cp "$f" "$saved/$f"
    overlaid+=("$f")
    cp "$dir/$f" "$f"
  done < <(cd "$dir" && find . -type f)
  build_one "$name"
  restore
  names+=("$name")
done

for r in $(seq 1 "$runs"); do
  for ps in $pass; do
    for d in $dims; do
      for n in "${names[@]}"; do
        "$out/bin/$n" bench --device cuda --pass "$ps" --d "$d" \
          --json "$out/json/${n}__${ps}_d${d}_run$r.json" > /dev/null 2>&1 ||
          echo "ab-bench.sh: bench failed: $n $ps d=$d run $r" >&2
      done
    done
  done
done

python3 - "$out" "${names[@]}" <<'PY' | tee "$out/ab.txt"
import glob, json, os, statistics, sys

out, names = sys.argv[1], sys.argv[2:]
cells = {}  # (pass, s, d, causal) -> name -> [tflops]
for path in glob.glob(os.path.join(out, "json", "*.json")):
    name = os.path.basename(path).split("__")[0]
    doc = json.load(open(path))
    for row in doc["rows"]:
        if row.get("tflops"):
            key = (row["pass"], row["s_q"], row["d"], row["causal"])
            cells.setdefault(key, {}).setdefault(name, []).append(row["tflops"])
card = ""
for path in glob.glob(os.path.join(out, "json", "*.json")):
    card = json.load(open(path)).get("card", "")
    break
print("card: %s; TFLOP/s, mean of the runs; ratio = variant / base" % card)
print("%-28s %8s" % ("cell", "base") + "".join("%18s" % n for n in names[1:]))
ratios = {n: [] for n in names[1:]}
for key in sorted(cells):
    base = cells[key].get("base")
    if not base:
        continue
    mb = statistics.mean(base)
    line = "%-6s s=%-6d d=%-4d %-6s %8.1f" % (key[0], key[1], key[2],
                                              "causal" if key[3] else "", mb)
    for n in names[1:]:
        if cells[key].get(n):
            mean = statistics.mean(cells[key][n])
            ratios[n].append(mean / mb)
            line += "%10.1f x%.3f" % (mean, mean / mb)
    print(line)
for n in names[1:]:
    if ratios[n]:
        print("%s: median x%.3f, min %.3f, max %.3f over %d cells" %
              (n, statistics.median(ratios[n]), min(ratios[n]), max(ratios[n]), len(ratios[n])))
PY
