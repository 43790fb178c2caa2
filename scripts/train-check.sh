#!/usr/bin/env bash
# train-check.sh — the training program's GPU evidence in one call: is flare-train's first step
# right, does it learn what PyTorch learns on the real corpus, and how fast is it against
# torch.compile on the same card.
#
#   scripts/train-check.sh --out DIR --build BUILD_DIR [--quick] [--data CORPUS_DIR]
#                          [--budget SECONDS] [--device cuda|cpu] [--work DIR]
#
# BUILD_DIR holds a build with apps (BUILD_DIR/apps/train/flare-train; CUDA for the real run).
# Python: $PYTHON (default python3) with torch and numpy; matplotlib for the PNG (else JSON only).
# The commit recorded is $FLARE_COMMIT when set (a copy of the tree without .git), else git's.
#
# 1. First step, both families (bench/train_compare.py): a small GPT and a small LLaMA (GQA 4:1,
#    RoPE; head dims 64 and 80; LLaMA-3 RoPE scaling with tied embeddings, and without scaling
#    untied; GPT-2's 50257-token vocabulary padded to 50304), random tokens with 5% ignored
#    targets: `prepare` writes the weights and the batch, `flare-train --init-weights
#    --dump-step` runs one forward/backward from them (deterministic attention), the weights it
#    ran with must be the prepared ones bit for bit, and `compare` checks the loss, the logits and
# every gradient against the fp64 reference under the tolerance rule of docs/architecture.md
# (2·naive + u·max|ref|).
#    -> DIR/first_step_<family>-d<head_dim>.json
# 2. Loss curves on the real corpus (scripts/prepare_data.py: Python docs, GPT-2 BPE; --data
#    takes shards made elsewhere, as the GPU machine has neither the corpus nor the tokenizer's
#    ranks): GPT-2 124M, batch 8 x 1024, 200 steps, flare-train and bench/train_torch.py (eager:
#    the reference arithmetic, no compile time) from the same initial weights (flare's own for
#    seed 1337, dumped once and read by both), the same batches, the same schedule, validation
#    every 50 steps. The band: two correct bf16 runs never agree bit for bit, so the noise is
#    measured as the distance between the PyTorch run with SDPA's cuDNN backend (the reference
#    curve) and with its flash backend; flare passes when its trailing-mean (10 steps) distance
#    from the reference, over the whole curve and at the end, is within 3 x that noise + 0.02
#    nats (bench/plot_train.py --noise; the rule and constants of bench/gpt_loss.py).
#    -> DIR/loss_curve.json (curves, distances, max relative difference over the last 20 steps)
#       and DIR/loss_curve.png
# 3. Throughput, flare-train (--nondeterministic, random tokens) then train_torch.py
#    (torch.compile, SDPA cuDNN) per case, same card, same call: GPT-2 124M b16 s1024,
#    GPT-3 2.7B b4 s1024, LLaMA-3.2 1B s4096 (b4, halved while flare-train refuses it as too
#    big), GPT-3 2.7B b8 s1024 last (where it does not fit, flare-train refuses before allocating:
#    a row with its "error"). -> DIR/train-<card>-<date>.json (bench/train_results.py)
#
# Every command runs under `timeout`, and the whole under --budget seconds (default 450): a step
# gets at most what is left, and one that would start with less than 20 s is skipped, so the
# later cases, not the correctness steps, are the ones that go. One summary line per step in
# DIR/summary.log ("== RESULT <step>: PASS|FAIL|ERROR|SKIP ..."). Exit status 1 when a
# correctness check failed or a step could not run (the others still run), else 0.
#
# --quick: a dry run of every path in about two minutes (one case per family, 30 curve steps on
# GPT-2 at 4 x 256, GPT-2 throughput only). --device cpu: the same script on a machine without a
# GPU, for checking it: the first step in fp32 against fp64, the curves of tiny models against
# torch fp32 (noise: torch fp32 vs fp64), flare-train's throughput rows of tiny models (torch's
# side is skipped: it needs CUDA).
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
export PYTHONUNBUFFERED=1

usage="usage: scripts/train-check.sh --out DIR --build BUILD_DIR [--quick] [--data CORPUS_DIR] [--budget SECONDS] [--device cuda|cpu] [--work DIR]"
out="" build="" quick=0 data="" budget=450 device="cuda" work=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="${2:-}"; shift 2 ;;
    --build) build="${2:-}"; shift 2 ;;
    --quick) quick=1; shift ;;
    --data) data="${2:-}"; shift 2 ;;
    --budget) budget="${2:-}"; shift 2 ;;
    --device) device="${2:-}"; shift 2 ;;
    --work) work="${2:-}"; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "train-check.sh: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
[[ -n "$out" && -n "$build" ]] || { echo "train-check.sh: --out and --build are required" >&2; echo "$usage" >&2; exit 2; }
[[ "$device" == cuda || "$device" == cpu ]] || { echo "train-check.sh: --device '$device' must be cuda or cpu" >&2; exit 2; }
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "train-check.sh: --budget '$budget' must be a whole number of seconds" >&2; exit 2; }
ft="$(cd "$build" 2>/dev/null && pwd)/apps/train/flare-train"
[[ -x "$ft" ]] || { echo "train-check.sh: --build '$build': no apps/train/flare-train in it (configure with apps)" >&2; exit 2; }
if [[ -n "$data" ]]; then
  data="$(cd "$data" 2>/dev/null && pwd)" || { echo "train-check.sh: --data: no directory '$data'" >&2; exit 2; }
  compgen -G "$data/*_train_*.bin" >/dev/null || { echo "train-check.sh: --data '$data': no *_train_*.bin shards (scripts/prepare_data.py --out DIR makes them)" >&2; exit 2; }
fi

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root" || exit 2
mkdir -p "$out" && out="$(cd "$out" && pwd)"
# Weights, dumps, logits and shards are large: they live in the work folder, not in DIR.
work="${work:-${TMPDIR:-/tmp}/train-check.$$}"
mkdir -p "$work" && work="$(cd "$work" && pwd)"
py="${PYTHON:-python3}"
: > "$out/summary.log"
deadline=$(( SECONDS + budget ))
status=0
log() { echo "== $*" | tee -a "$out/summary.log"; }
result() {  # STEP VERDICT DETAIL: the one summary line of a step
  log "RESULT $1: $2${3:+ $3}"
  [[ "$2" == FAIL || "$2" == ERROR ]] && status=1
  return 0
}

# bounded WANT LOG CMD...: CMD under timeout, limited to WANT seconds and to what is left of the
# budget; output appended to LOG. Returns CMD's status, 124/137 when stopped, 125 when no time
# was left to start it.
bounded() {
  local want=$1 logf=$2 left lim
  shift 2
  left=$(( deadline - SECONDS ))
  if (( left < 20 )); then
    echo "not started: the budget is spent" >> "$logf"
    return 125
  fi
  lim=$(( want < left ? want : left ))
  echo "\$ $* (limit ${lim} s)" >> "$logf"
  timeout --kill-after=10 "$lim" "$@" >> "$logf" 2>&1
}
why() {  # STATUS LOG: a short reason for a failed bounded command
  case "$1" in
    124|137) echo "timed out ($2)" ;;
    125) echo "not started, budget spent" ;;
    *) echo "exit $1: $(grep -v '^\$ ' "$2" | tail -1 | cut -c1-300)" ;;
  esac
}

if [[ "$device" == cuda ]]; then
  card="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/nvidia-smi.log" 2>&1
  [[ -n "$card" ]] || { log "no GPU visible to nvidia-smi (use --device cpu for a dry run)"; exit 1; }
else
  card="cpu"
fi
log "train-check: card '$card', flare-train $ft, commit ${FLARE_COMMIT:-from git}, python $py ($("$py" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)), budget ${budget} s, work $work$([[ $quick -eq 1 ]] && echo ', quick')"
dev_flags=(--device "$device")

# ---- 1. first step, both families --------------------------------------------------------------
# A case: TAG BASE_PRESET BATCH SEQ FIELD=VALUE...; the fields are ModelConfig's, given to
# train_compare.py as JSON over the preset and to flare-train as the matching flags.
if [[ "$device" == cuda ]]; then
  first_cases=(
    "gpt-d80 gpt3-2.7b 4 200 n_layer=2 d_model=320 n_head=4 n_kv_head=4 head_dim=80 ffn_hidden=1280 vocab_size=50257"
    "llama-d64 llama3.2-1b 4 200 n_layer=2 d_model=512 n_head=8 n_kv_head=2 head_dim=64 ffn_hidden=1408 max_seq=1024 vocab_size=50257"
    "gpt-d64 gpt2 4 256 n_layer=2 d_model=384 n_head=6 n_kv_head=6 head_dim=64 ffn_hidden=1536 vocab_size=50257"
    "llama-d80 llama3-8b 4 256 n_layer=2 d_model=640 n_head=8 n_kv_head=2 head_dim=80 ffn_hidden=1720 max_seq=1024 vocab_size=50257"
  )
else  # the CPU model in fp32: narrower, shorter, the same head dims and features
  first_cases=(
    "gpt-d80 gpt3-2.7b 2 40 n_layer=2 d_model=160 n_head=2 n_kv_head=2 head_dim=80 ffn_hidden=640 max_seq=64 vocab_size=1000"
    "llama-d64 llama3.2-1b 2 40 n_layer=2 d_model=256 n_head=4 n_kv_head=2 head_dim=64 ffn_hidden=344 max_seq=64 vocab_size=1000"
    "gpt-d64 gpt2 2 33 n_layer=2 d_model=128 n_head=2 n_kv_head=2 head_dim=64 ffn_hidden=512 max_seq=64 vocab_size=1000"
    "llama-d80 llama3-8b 2 33 n_layer=2 d_model=320 n_head=4 n_kv_head=2 head_dim=80 ffn_hidden=432 max_seq=64 vocab_size=1000"
  )
fi
[[ $quick -eq 1 ]] && first_cases=("${first_cases[@]:0:2}")
first_limit=$([[ "$device" == cuda ]] && echo 120 || echo 300)

first_step() {  # TAG BASE BATCH SEQ FIELD=VALUE...
  local tag=$1 base=$2 batch=$3 seq=$4
  shift 4
  local dir="$work/first_step/$tag" logf="$out/first_step_$tag.log" json="{\"preset\": \"$base\"" flags=() kv key rc
  rm -rf "$dir" && mkdir -p "$dir"
  : > "$logf"
  for kv in "$@"; do
    key=${kv%%=*}
    json+=", \"$key\": ${kv#*=}"
    [[ $key == vocab_size ]] && flags+=(--vocab "${kv#*=}") || flags+=("--${key//_/-}" "${kv#*=}")
  done
  echo "$json}" > "$dir/config.json"
  local start=$SECONDS
  bounded 60 "$logf" "$py" bench/train_compare.py prepare --model "$base" --config-json "$dir/config.json" \
    --batch "$batch" --seq "$seq" --out "$dir"
  rc=$?; (( rc == 0 )) || { result "first step $tag" ERROR "prepare: $(why "$rc" "$logf")"; return; }
  cp "$dir/weights.bin" "$dir/prepared_weights.bin"
  bounded "$first_limit" "$logf" "$ft" --model "$base" "${flags[@]}" --data "$work/synth_small" \
    --batch "$batch" --seq "$seq" --init-weights "$dir/prepared_weights.bin" --dump-step "$dir" \
    --sample 0 --no-checkpoint "${dev_flags[@]}"
  rc=$?; (( rc == 0 )) || { result "first step $tag" FAIL "flare-train --dump-step: $(why "$rc" "$logf")"; return; }
  if ! cmp -s "$dir/prepared_weights.bin" "$dir/weights.bin"; then
    result "first step $tag" FAIL "the dumped weights differ from --init-weights' file"
    return
  fi
  rm -f "$out/first_step_$tag.json"
  bounded "$first_limit" "$logf" "$py" bench/train_compare.py compare "$dir" --device "$device" \
    --out "$out/first_step_$tag.json"
  rc=$?
  local verdict
  verdict=$("$py" - "$out/first_step_$tag.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
worst = max(r["rows"], key=lambda row: row["ratio"])
bad = [row["tensor"] for row in r["rows"] if not row["pass"]]
print(f"{r['model']} {r['batch']}x{r['seq']} {r['precision']} on {r['device']}: "
      f"{len(r['rows']) - len(bad)}/{len(r['rows'])} tensors within 2*naive + u*max|ref|, "
      f"worst {worst['tensor']} at {worst['ratio']:.2f} of its bound"
      + (f"; failing: {', '.join(bad[:6])}" if bad else ""))
EOF
)
  if (( rc == 0 )); then
    result "first step $tag" PASS "$verdict ($(( SECONDS - start )) s)"
  elif [[ -n "$verdict" ]]; then
    result "first step $tag" FAIL "$verdict"
  else
    result "first step $tag" ERROR "compare: $(why "$rc" "$logf")"
  fi
}

log "step 1: first step against the fp64 reference (${#first_cases[@]} cases)"
if bounded 60 "$out/first_step.log" "$ft" synth-data --out "$work/synth_small" --tokens 65536 --vocab 1000; then
  for c in "${first_cases[@]}"; do
    # shellcheck disable=SC2086  # a case is a word list
    first_step $c
  done
else
  result "first step" ERROR "synth-data: $(why $? "$out/first_step.log")"
fi
rm -rf "$work/first_step"

# ---- 2. loss curves on the real corpus ------------------------------------------------------------
if [[ "$device" == cuda ]]; then
  if [[ $quick -eq 1 ]]; then
    curve=(gpt2 4 256 30 10)  # MODEL BATCH SEQ STEPS EVAL_EVERY
  else
    curve=(gpt2 8 1024 200 50)
  fi
  curve_flags=()
  torch_ref=(--backend cudnn) torch_noise=(--backend flash)
  ref_label="torch-cudnn" noise_label="torch-flash"
else
  curve=(gpt-tiny 4 32 40 20)  # the CPU model pays for GPT-2's 50257-row classifier
  [[ $quick -eq 1 ]] && curve=(gpt-tiny 4 32 20 10)
  curve_flags=(--d-model 128 --n-head 2 --head-dim 64 --max-seq 128)
  torch_ref=(--cpu --precision fp32) torch_noise=(--cpu --precision fp64)
  ref_label="torch-fp32" noise_label="torch-fp64"
fi
read -r c_model c_batch c_seq c_steps c_eval <<< "${curve[*]}"
curve_step() {
  local logf="$out/loss_curve.log" rc start=$SECONDS
  : > "$logf"
  if [[ -z "$data" ]]; then
    if compgen -G "data/pydoc/*_train_*.bin" >/dev/null; then
      data="$root/data/pydoc"
    else
      bounded 180 "$logf" "$py" scripts/prepare_data.py --out "$work/pydoc"
      rc=$?; (( rc == 0 )) || { result "loss curve" ERROR "prepare_data.py (no corpus or GPT-2 ranks here? make the shards elsewhere and pass --data): $(why "$rc" "$logf")"; return; }
      data="$work/pydoc"
      log "corpus prepared in $(( SECONDS - start )) s: $(grep -E '^prepare_data: train' "$logf")"
    fi
  fi
  log "step 2: loss curves, $c_model batch $c_batch x $c_seq, $c_steps steps, corpus $data"
  # flare's own initial weights for seed 1337, read by both runs: the dump of a one-sequence step.
  bounded 120 "$logf" "$ft" --model "$c_model" "${curve_flags[@]}" --data "$data" --batch 1 \
    --seq 16 --dump-step "$work/curve_init" --sample 0 --no-checkpoint "${dev_flags[@]}"
  rc=$?; (( rc == 0 )) || { result "loss curve" ERROR "initial weights (flare-train --dump-step): $(why "$rc" "$logf")"; return; }
  local init="$work/curve_init/weights.bin"
  rm -f "$out/loss_curve_flare.jsonl"
  bounded 300 "$logf" "$ft" --model "$c_model" "${curve_flags[@]}" --data "$data" --batch "$c_batch" \
    --seq "$c_seq" --steps "$c_steps" --eval-every "$c_eval" --init-weights "$init" \
    --log "$out/loss_curve_flare.jsonl" --sample 0 --no-checkpoint "${dev_flags[@]}"
  rc=$?; (( rc == 0 )) || { result "loss curve" ERROR "flare-train: $(why "$rc" "$logf")"; return; }
  local torch_common=(--case "$c_model:$c_batch:$c_seq" --data "$data/*_train_*.bin"
                      --val-data "$data/*_val_*.bin" --train-steps "$c_steps" --eval-every "$c_eval"
                      --init "$init" --no-compile)
  [[ "$device" == cpu ]] && torch_common+=(--config-json "$work/curve_config.json")
  if [[ "$device" == cpu ]]; then  # the tiny model's overrides, as train_torch.py reads them
    echo '{"preset": "gpt-tiny", "d_model": 128, "n_head": 2, "n_kv_head": 2, "head_dim": 64, "ffn_hidden": 512, "max_seq": 128, "vocab_size": 50257}' \
      > "$work/curve_config.json"
  fi
  bounded 300 "$logf" "$py" bench/train_torch.py "${torch_common[@]}" "${torch_ref[@]}" \
    --log "$out/loss_curve_$ref_label.json"
  rc=$?; (( rc == 0 )) || { result "loss curve" ERROR "train_torch.py ($ref_label): $(why "$rc" "$logf")"; return; }
  bounded 300 "$logf" "$py" bench/train_torch.py "${torch_common[@]}" "${torch_noise[@]}" \
    --log "$out/loss_curve_$noise_label.json"
  rc=$?; (( rc == 0 )) || { result "loss curve" ERROR "train_torch.py ($noise_label): $(why "$rc" "$logf")"; return; }
  local png=()
  if "$py" -c "import matplotlib" 2>/dev/null; then
    png=(--out "$out/loss_curve.png")
  else
    log "matplotlib missing: no PNG (bench/plot_train.py --out draws it from the logs in DIR elsewhere)"
  fi
  bounded 120 "$logf" "$py" bench/plot_train.py "$out/loss_curve_$ref_label.json" \
    "$out/loss_curve_flare.jsonl" "$out/loss_curve_$noise_label.json" \
    --label "$ref_label" --label flare-train --label "$noise_label" \
    --noise "$out/loss_curve_$ref_label.json" "$out/loss_curve_$noise_label.json" \
    --window 10 --last 20 --title "$c_model b$c_batch x $c_seq on $(basename "$data"): flare-train vs PyTorch ($card)" \
    --json "$out/loss_curve.json" "${png[@]}"
  rc=$?
  local verdict
  verdict=$(grep -E "^flare-train vs" "$logf" | tail -1)
  if (( rc == 0 )) && [[ -n "$verdict" ]]; then
    result "loss curve" PASS "$verdict ($(( SECONDS - start )) s)"
  elif (( rc == 1 )) && [[ -n "$verdict" ]]; then
    result "loss curve" FAIL "$verdict"
  else
    result "loss curve" ERROR "plot_train.py: $(why "$rc" "$logf")"
  fi
  grep -E "^noise" "$logf" | tail -1 | tee -a "$out/summary.log"
}
curve_step
rm -rf "$work/curve_init"

# ---- 3. throughput, flare-train vs torch.compile -------------------------------------------------
# A case: MODEL BATCH SEQ FLARE_STEPS FIT TORCH_RANK. FIT=halve tries half the batch while
# flare-train refuses the run as too big for the device; torch then runs at the batch flare-train
# ran. Every flare-train run comes first (a few seconds each); then the torch.compile runs, whose
# compilation takes most of the step's time, in TORCH_RANK order, so that a budget that runs out
# takes the peer's rows least needed: GPT-3 2.7B b4 (the headline ratio), LLaMA (never measured
# before), GPT-2, GPT-3 2.7B b8 (the case that may not fit).
if [[ "$device" == cuda ]]; then
  if [[ $quick -eq 1 ]]; then
    tp_cases=("gpt2 16 1024 12 fixed 1")
    torch_steps=(--warmup 3 --steps 5)
  else
    tp_cases=("gpt2 16 1024 40 fixed 3" "gpt3-2.7b 4 1024 30 fixed 1" "llama3.2-1b 4 4096 20 halve 2"
              "gpt3-2.7b 8 1024 20 fixed 4")
    torch_steps=(--warmup 5 --steps 15)
  fi
  tp_data_flags=()
else
  tp_cases=("gpt-tiny 8 64 12 fixed 2" "llama-tiny 8 64 12 fixed 1")
  tp_data_flags=(--vocab 300)
fi
log "step 3: throughput (${#tp_cases[@]} cases)"
merge_args=()
torch_runs=()  # "RANK MODEL BATCH SEQ" of each case flare-train ran or refused
tp_flare() {  # MODEL BATCH SEQ STEPS FIT RANK
  local m=$1 b=$2 s=$3 n=$4 fit=$5 rank=$6 tag flog fjson rc refused start
  while :; do
    tag="${m}_b${b}_s${s}"
    flog="$out/tp_flare_$tag.log" fjson="$out/tp_flare_$tag.jsonl"
    rm -f "$flog" "$fjson"
    start=$SECONDS
    bounded 180 "$flog" "$ft" --model "$m" --data "$work/synth" --batch "$b" --seq "$s" --steps "$n" \
      --warmup 5 --eval-every 0 --sample 0 --no-checkpoint --nondeterministic --log "$fjson" \
      "${tp_data_flags[@]}" "${dev_flags[@]}"
    rc=$?
    refused=0
    (( rc == 1 )) && grep -qiE "out of memory|training needs about|the run needs" "$flog" && refused=1
    if (( refused && b > 1 )) && [[ $fit == halve ]]; then
      log "flare-train $m b$b s$s refused as too big; trying b$(( b / 2 ))"
      b=$(( b / 2 ))
      continue
    fi
    break
  done
  merge_args+=(--flare "$m:$b:$s:$flog:$fjson")
  torch_runs+=("$rank $m $b $s")
  if (( rc == 0 )); then
    result "throughput flare-train $m b$b s$s" PASS "$(grep '^throughput' "$flog") ($(( SECONDS - start )) s)"
  elif (( refused )); then
    result "throughput flare-train $m b$b s$s" PASS "refused before allocating (a row with its error): $(grep '^flare-train:' "$flog" | tail -1 | cut -c1-300)"
  else
    result "throughput flare-train $m b$b s$s" ERROR "$(why "$rc" "$flog")"
  fi
}
tp_torch() {  # MODEL BATCH SEQ
  local m=$1 b=$2 s=$3 tdir="$work/torch_${1}_b${2}_s${3}" tlog="$out/tp_torch_${1}_b${2}_s${3}.log" rc tjson start=$SECONDS
  if [[ "$device" != cuda ]]; then
    merge_args+=(--missing "torch-compile:$m:$b:$s:not run: train_torch.py needs CUDA")
    return
  fi
  rm -rf "$tdir"; : > "$tlog"
  bounded 240 "$tlog" "$py" bench/train_torch.py --case "$m:$b:$s" "${torch_steps[@]}" --out "$tdir"
  rc=$?
  tjson=$(compgen -G "$tdir/train_torch-*.json" | head -1)
  if [[ -n "$tjson" ]]; then
    merge_args+=(--torch "$tjson")
    cp "$tjson" "$out/tp_torch_${m}_b${b}_s${s}.json"
  else
    merge_args+=(--missing "torch-compile:$m:$b:$s:$(why "$rc" "$tlog")")
  fi
  if (( rc == 0 )); then
    result "throughput torch-compile $m b$b s$s" PASS "$(grep -E 'tokens/s' "$tlog" | tail -1 | tr -s ' ') ($(( SECONDS - start )) s)"
  elif [[ -n "$tjson" ]] && grep -q "out of memory" "$tlog"; then
    result "throughput torch-compile $m b$b s$s" PASS "out of memory (a row with its error)"
  else
    result "throughput torch-compile $m b$b s$s" ERROR "$(why "$rc" "$tlog")"
  fi
}
if bounded 120 "$out/throughput.log" "$ft" synth-data --out "$work/synth" "${tp_data_flags[@]}"; then
  for c in "${tp_cases[@]}"; do
    # shellcheck disable=SC2086  # a case is a word list
    tp_flare $c
  done
  while read -r _ m b s; do
    tp_torch "$m" "$b" "$s"
  done < <(printf '%s\n' "${torch_runs[@]}" | sort -n)
else
  reason="synth-data: $(why "$?" "$out/throughput.log")"
  result "throughput" ERROR "$reason"
  for c in "${tp_cases[@]}"; do
    read -r m b s _ <<< "$c"
    merge_args+=(--missing "flare-train:$m:$b:$s:$reason" --missing "torch-compile:$m:$b:$s:$reason")
  done
fi
[[ "$device" == cuda ]] &&
  merge_args+=(--software "driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)")
# The merge runs whatever the budget says: it is what the step leaves behind.
if "$py" bench/train_results.py --out "$out" --card "$card" "${merge_args[@]}" \
     --note "flare-train --nondeterministic on random tokens (median step of print_throughput) vs bench/train_torch.py (torch.compile, SDPA cuDNN, bf16 autocast, fused AdamW); same card, same call; scripts/train-check.sh" \
     > "$out/train_results.log" 2>&1; then
  tee -a "$out/summary.log" < "$out/train_results.log"
  result "throughput results" PASS "$(grep -E '^wrote' "$out/train_results.log")"
else
  result "throughput results" ERROR "train_results.py: $(tail -1 "$out/train_results.log")"
fi
rm -rf "$work/synth" "$work/synth_small" "$work"/torch_* "$work/curve_config.json"
rmdir "$work" 2>/dev/null  # kept where it holds a corpus prepared here

# The per-command logs go into one archive, so that DIR keeps a handful of files (the results, the
# chart, summary.log): machines that hand back only a few files lose nothing that matters.
(cd "$out" && find . -maxdepth 1 -type f \( -name '*.log' ! -name summary.log -o -name '*.jsonl' \) \
   -printf '%f\n' | tar czf logs.tgz -T - && find . -maxdepth 1 -type f \
   \( -name '*.log' ! -name summary.log -o -name '*.jsonl' \) -delete)

log "done in $SECONDS s (status $status)"
exit $status
