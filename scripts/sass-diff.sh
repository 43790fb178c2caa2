#!/usr/bin/env bash
# sass-diff.sh — do two builds of the kernels compile to the same machine code?
#
#   scripts/sass-diff.sh [--arch sm_90a] A B
#
# A and B are object files, or folders of them with the same names (e.g. copies of
# BUILD/CMakeFiles/flare.dir/generated/flare/sm80 taken before and after a change). For every
# object in both and every GPU architecture it holds (or only --arch), each kernel's SASS is
# compared whole, with addresses, encodings and comments stripped. One line per (object, arch):
# "identical", or the instruction counts of both, the number of differing lines and the opcodes
# whose counts differ ("same opcode mix" when only the schedule or the registers moved).
# Exit status 0 when everything is identical, 1 when something differs, 2 on a usage error.
#
# Whole kernels matter: these run to 6,000-13,000 instructions, and a check that keeps only
# four-digit addresses (/*0000*/ .. /*fff0*/) sees the first 4,096 of them.
# Needs cuobjdump from a CUDA toolkit (on PATH, in $CUDA_HOME/bin, or given as CUOBJDUMP=path).
# A toolkit without it (no GPU needed either): pip install nvidia-cuda-cuobjdump
# nvidia-cuda-nvdisasm, then CUOBJDUMP=<site-packages>/nvidia/cu13/bin/cuobjdump (it disassembles
# through the nvdisasm beside it; without one it prints no SASS).
set -uo pipefail

arch=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) arch="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [[ ${#args[@]} -ne 2 ]]; then
  echo "sass-diff.sh: give two object files or two folders of them (see --help)" >&2
  exit 2
fi
a="${args[0]}" b="${args[1]}"
cuobjdump="${CUOBJDUMP:-$(command -v cuobjdump || echo "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump")}"
if [[ ! -x "$cuobjdump" ]]; then
  echo "sass-diff.sh: cuobjdump not found (set CUOBJDUMP=path or put the CUDA toolkit's bin on PATH)" >&2
  exit 2
fi

# Pairs of objects to compare: the two files, or the names present in both folders.
pairs=()
if [[ -f "$a" && -f "$b" ]]; then
  pairs+=("$a|$b")
elif [[ -d "$a" && -d "$b" ]]; then
  for f in "$a"/*.o; do
    [[ -e "$f" ]] || continue
    n=$(basename "$f")
    if [[ -f "$b/$n" ]]; then pairs+=("$f|$b/$n"); else echo "$n: only in $a"; fi
  done
else
  echo "sass-diff.sh: '$a' and '$b' must both be files or both be folders" >&2
  exit 2
fi
[[ ${#pairs[@]} -gt 0 ]] || { echo "sass-diff.sh: no object files to compare" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Normalised SASS of one object, one file per architecture: $2/<arch>.sass.
split_sass() {
  mkdir -p "$2"
  "$cuobjdump" -sass "$1" 2>/dev/null | awk -v dir="$2" '
    /code for sm_/ { for (i = 1; i <= NF; ++i) if ($i ~ /^sm_/) arch = $i; next }
    /Function :/ { if (arch != "") print "FUNCTION " $NF > (dir "/" arch ".sass"); next }
    /^[[:space:]]+\/\*[0-9a-f]+\*\// {
      if (arch == "") next
      line = $0
      sub(/^[[:space:]]*\/\*[0-9a-f]+\*\/[[:space:]]*/, "", line)
      gsub(/\/\*[^*]*\*\//, "", line)
      gsub(/[[:space:]]+/, " ", line)
      sub(/ $/, "", line)
      print line > (dir "/" arch ".sass")
    }'
}

# "OPCODE COUNT" per opcode (guards dropped), sorted for join.
opcode_counts() {
  grep -v '^FUNCTION' "$1" | awk '{ o = ($1 ~ /^@/) ? $2 : $1; n[o]++ } END { for (o in n) print o, n[o] }' |
    LC_ALL=C sort
}

status=0
i=0
for pair in "${pairs[@]}"; do
  fa="${pair%%|*}" fb="${pair##*|}" name=$(basename "$fa")
  i=$((i + 1))
  split_sass "$fa" "$tmp/$i/a"
  split_sass "$fb" "$tmp/$i/b"
  for sa in "$tmp/$i/a"/*.sass; do
    [[ -e "$sa" ]] || { echo "$name: no SASS"; status=1; break; }
    an=$(basename "$sa" .sass)
    [[ -z "$arch" || "$an" == "$arch" ]] || continue
    sb="$tmp/$i/b/$an.sass"
    if [[ ! -f "$sb" ]]; then echo "$name $an: only in $a"; status=1; continue; fi
    na=$(grep -vc '^FUNCTION' "$sa") nb=$(grep -vc '^FUNCTION' "$sb")
    nd=$(diff "$sa" "$sb" | grep -c '^[<>]')
    if [[ $nd -eq 0 ]]; then
      echo "$name $an: identical ($na instructions)"
      continue
    fi
    status=1
    mix=$(join -a1 -a2 -e 0 -o 0,1.2,2.2 <(opcode_counts "$sa") <(opcode_counts "$sb") |
          awk '$2 != $3 { printf "%s%s %d->%d", sep, $1, $2, $3; sep = ", " }')
    echo "$name $an: differs: $na vs $nb instructions, $nd lines differ; ${mix:-same opcode mix}"
  done
done
exit $status
