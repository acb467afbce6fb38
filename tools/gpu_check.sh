#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, inside 8 minutes, from the repo root of an offline box.
#
#   tools/fetch_gpu_wheels.sh       # first, where PyPI is reachable: wheels/ (megatron-core, math-verify, ...)
#   tools/gpu_check.sh              # then on the GPU box (python 3.12 + CUDA torch + transformers, no network)
#
# Steps (each with its own timeout, all inside GPU_CHECK_BUDGET_S; one failing does not stop the others):
#   setup          install wheels/*.whl offline into $WORK/site (pip --target --no-index --no-deps;
#                  PYTHONPATH=$WORK/site:repo), print versions and the GPU, check torch.cuda.is_available()
#   cuda_tests     pytest tests/test_shared_prompt.py -k cuda: compiled FlexAttention (shared-prompt
#                  masks) forward and backward equal to SDPA; fails when every selected test is skipped
#   bf16_master    the default config, model.dtype=bfloat16 actor.fp32_master_weights=true, 100 steps
#   default_job    the default job (configs/default.yaml, 300 steps); with one GPU in trainer.mode=sync
#                  (periodic puts the rollout worker on a second GPU; see below)
#   periodic_1gpu  with one GPU only: the default periodic mode must refuse in one line ("need 2 cuda devices")
#   large          if time is left: a ~135M-parameter random Qwen2 (bf16, 32 new tokens), 12 steps
#   large_shared   the same with actor.shared_prompt=true (FlexAttention inside the model, on the GPU)
# tokens/s is perf/throughput (prompt + response tokens per second per device) from metrics.jsonl,
# mean over the steps after the first; the summary table is printed and written to $OUT/summary.md,
# one log per step next to it ($OUT gets at most 8 files: 7 logs + summary.md). Exit status: 0 when
# every step that ran passed.
#
# Environment:
#   OUT=DIR                 logs + summary.md (default /tmp/gpu_check_out)
#   GPU_CHECK_WORK=DIR      run dirs, site-packages, caches (default /tmp/gpu_check_work; wiped first)
#   PYTHON=python3          the interpreter holding the box's CUDA torch and transformers
#   GPU_CHECK_NO_INSTALL=1  use $PYTHON as it is (no wheels installed; alias GPU_CHECK_NO_VENV=1)
#   GPU_CHECK_BACKEND=cpu   dry run of the plumbing on a CPU: same steps, cpu backend, a few steps
#                           each, smaller "large" model (cuda_tests then reports all skipped: a failure)
#   GPU_CHECK_BUDGET_S=470  the whole run's time budget in seconds
#
# Why no venv: the box's python3 is itself a venv (/opt/torch/.venv); a venv made from it with
# --system-site-packages sees the base interpreter's site-packages, not that venv's, so torch would
# vanish. Installing into a --target folder on PYTHONPATH keeps the box's packages and puts ours first.
set -u
set -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

T0=$(date +%s)
BACKEND="${GPU_CHECK_BACKEND:-cuda}"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
OUT="${OUT:-/tmp/gpu_check_out}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
PY="${PYTHON:-python3}"
NO_INSTALL="${GPU_CHECK_NO_INSTALL:-${GPU_CHECK_NO_VENV:-0}}"
TESTED_TRANSFORMERS="5.17.0"   # the oldest transformers the CPU dry run was checked with (box image: 5.17.0)

mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK"
RESULTS="$WORK/results.tsv"
: > "$RESULTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPYCACHEPREFIX="$WORK/pycache"   # bytecode under $WORK: no __pycache__ left in the checkout
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton"

say() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$RESULTS"; }   # step status seconds tokens/s notes

# ---------------------------------------------------------------------- the report helper (python)
cat > "$WORK/report.py" <<'EOF'
import json, os, statistics, sys, xml.etree.ElementTree as ET

def train(run_dir, rc):
    """status, tokens/s, notes from a run's metrics.jsonl (tokens/s: mean perf/throughput over steps 2..)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            recs = [json.loads(l) for l in f if l.strip()]
    if not recs:
        return "fail", "-", f"rc {rc}, no metrics"
    tail = recs[1:] or recs
    tps = [r["perf/throughput"] for r in tail if isinstance(r.get("perf/throughput"), (int, float))]
    step_s = [r["timing_s/step"] for r in tail if isinstance(r.get("timing_s/step"), (int, float))]
    sc = [r.get("critic/score/mean") for r in recs]
    last10 = [s for s in sc[-10:] if isinstance(s, (int, float))]
    skipped = sum(1 for r in recs if r.get("actor/step_skipped"))
    notes = [f"{len(recs)} steps", f"score {sc[0]:.3f} -> {sc[-1]:.3f} (last {len(last10)}: {statistics.fmean(last10):.3f})"]
    if step_s:
        notes.append(f"step {statistics.median(step_s):.3f} s (median)")
    if tps:
        notes.append(f"tok/s median {statistics.median(tps):.0f}")
    if skipped:
        notes.append(f"{skipped} steps skipped (non-finite)")
    if rc != 0:
        notes.append(f"rc {rc}" + (" (timeout)" if rc in (124, 137) else ""))
    status = "pass" if rc == 0 else "fail"
    return status, (f"{statistics.fmean(tps):.0f}" if tps else "-"), ", ".join(notes)

def pytest(xml, rc):
    if not os.path.exists(xml):
        return "fail", "-", f"rc {rc}, no junit xml"
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    passed = n - fail - err - skip
    names = [c.get("name") for c in suite.iter("testcase")]
    note = f"{passed} passed, {fail} failed, {err} errors, {skip} skipped: {', '.join(names) or 'none selected'}"
    if n == 0:
        return "fail", "-", "no test selected"
    if skip == n:
        return "fail", "-", "all skipped (no CUDA?): " + note
    return ("pass" if rc == 0 and fail == err == 0 and passed > 0 else "fail"), "-", note

def summary(results, out_md, header):
    rows = [l.rstrip("\n").split("\t") for l in open(results) if l.strip()]
    lines = header.splitlines() + ["", "| step | result | seconds | tokens/s | notes |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {st} | {sec} | {tps} | {note} |" for s, st, sec, tps, note in rows]
    failed = [r[0] for r in rows if r[1] == "fail"]
    lines += ["", "all steps that ran passed" if not failed else f"FAILED: {', '.join(failed)}"]
    text = "\n".join(lines) + "\n"
    open(out_md, "w").write(text)
    print(text, end="")
    return 1 if failed else 0

if __name__ == "__main__":
    what = sys.argv[1]
    if what in ("train", "pytest"):
        st, tps, note = (train if what == "train" else pytest)(sys.argv[2], int(sys.argv[3]))
        print(f"{st}\t{tps}\t{note.replace(chr(9), ' ').replace('|', '/')}")
    elif what == "summary":
        sys.exit(summary(sys.argv[2], sys.argv[3], sys.argv[4]))
EOF

# Filter a step's output to a few progress lines on the console (the whole of it goes to the log).
progress() {
  awk -v p="  [$1] " '
    /^step +[0-9]+ \|/ { n = $2 + 0; if (n == 1 || n % 25 == 0) print p $0; fflush(); next }
    /Traceback|Error|error:|FAILED|PASSED|passed|failed|skipped|done:|refus|need/ { print p substr($0, 1, 300); fflush() }'
}

# run_step NAME LIMIT_S MIN_S KIND ARG -- CMD...   KIND: train RUN_DIR | pytest XML | expect REGEX
run_step() {
  local name="$1" limit="$2" min="$3" kind="$4" arg="$5"; shift 6
  local log="$OUT/$name.log" remain t rc start secs parsed status tps note
  remain=$(left)
  if (( remain < min )); then
    say "$name: skipped (${remain}s of the budget left, needs ${min}s)"
    record "$name" "skip" "0" "-" "not run: ${remain}s of the budget left"
    return
  fi
  t=$(( limit < remain - 5 ? limit : remain - 5 ))
  say "$name: start (timeout ${t}s): $*"
  { echo "\$ $*"; echo; } > "$log"
  start=$(date +%s)
  timeout -k 15 "$t" "$@" 2>&1 | tee -a "$log" | progress "$name"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  case "$kind" in
    train)
      parsed="$("$PY" "$WORK/report.py" train "$arg" "$rc")"
      if [[ -f "$arg/metrics.jsonl" ]]; then { echo; echo "=== $arg/metrics.jsonl ==="; cat "$arg/metrics.jsonl"; } >> "$log"; fi ;;
    pytest)
      parsed="$("$PY" "$WORK/report.py" pytest "$arg" "$rc")" ;;
    expect)   # the command must fail (rc != 0) with a line matching the regex
      if [[ $rc -ne 0 ]] && tail -n +3 "$log" | grep -qE "$arg"; then   # the output, not the "$ cmd" header
        parsed="pass	-	refused as expected: $(tail -n +3 "$log" | grep -E "$arg" | head -1 | cut -c1-200 | tr '|\t' '/ ')"
      else
        parsed="fail	-	rc $rc; no line matching /$arg/"
      fi ;;
  esac
  IFS=$'\t' read -r status tps note <<< "$parsed"
  record "$name" "$status" "$secs" "$tps" "$note"
  say "$name: $status in ${secs}s, tokens/s $tps; $note"
}

# ---------------------------------------------------------------------- setup
say "backend $BACKEND, budget ${BUDGET}s, python $PY, out $OUT, work $WORK"
SETUP_LOG="$OUT/setup.log"
: > "$SETUP_LOG"
setup_ok=1
setup_note=""
if [[ "$NO_INSTALL" != 1 ]]; then
  shopt -s nullglob
  whls=("$ROOT"/wheels/*.whl)
  shopt -u nullglob
  if (( ${#whls[@]} == 0 )); then
    say "setup: no wheels in $ROOT/wheels (run tools/fetch_gpu_wheels.sh where PyPI is reachable)"
    setup_ok=0; setup_note="no wheels/; "
  else
    say "setup: installing ${#whls[@]} wheels into $WORK/site (offline)"
    if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
         --target "$WORK/site" "${whls[@]}" >> "$SETUP_LOG" 2>&1; then
      setup_ok=0; setup_note="pip install failed; "
    fi
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
    # transformers: the box's when at least the version checked here, else the carried pin (wheels/fallback)
    tv="$("$PY" -c 'import importlib.metadata as m; print(m.version("transformers"))' 2>/dev/null || echo 0)"
    if ! "$PY" -c "import sys; from packaging.version import Version as V; sys.exit(V('$tv') < V('$TESTED_TRANSFORMERS'))" 2>/dev/null; then
      shopt -s nullglob; fb=("$ROOT"/wheels/fallback/transformers-*.whl); shopt -u nullglob
      if (( ${#fb[@]} )); then
        say "setup: transformers $tv < $TESTED_TRANSFORMERS: installing the carried ${fb[0]##*/}"
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
          --target "$WORK/site" "${fb[@]}" >> "$SETUP_LOG" 2>&1 || { setup_ok=0; setup_note+="transformers fallback failed; "; }
        setup_note+="transformers $tv replaced by ${fb[0]##*/}; "
      else
        setup_note+="transformers $tv older than $TESTED_TRANSFORMERS (not checked); "
      fi
    fi
  fi
fi
"$PY" - "$BACKEND" "$TESTED_TRANSFORMERS" > "$WORK/versions.txt" 2>> "$SETUP_LOG" <<'EOF'
import importlib.metadata as md, platform, sys, warnings
warnings.filterwarnings("ignore")
backend, tested = sys.argv[1], sys.argv[2]
ok = True
def ver(p):
    try:
        return md.version(p)
    except md.PackageNotFoundError:
        return "MISSING"
print(f"python {platform.python_version()} ({sys.executable})")
for p in ("torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface_hub", "numpy", "megatron-core",
          "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime", "pebble", "pyyaml", "tqdm", "pyarrow",
          "sympy", "packaging", "pytest", "pytest-timeout"):
    v = ver(p)
    print(f"{p} {v}")
    if v == "MISSING" and p not in ("triton", "pytest-timeout", "huggingface_hub"):
        ok = False
import torch
print(f"torch.version.cuda {torch.version.cuda}; cuda available {torch.cuda.is_available()}; "
      f"devices {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
elif backend == "cuda":
    print("ERROR: torch.cuda.is_available() is False")
    ok = False
from packaging.version import Version
if ver("transformers") != "MISSING" and Version(ver("transformers")) < Version(tested):
    print(f"WARNING: transformers {ver('transformers')} is older than {tested}, the oldest checked with this code")
for mod in ("megatron.core.parallel_state", "megatron.core.models.gpt", "math_verify", "pebble", "yaml", "tqdm",
            "pyarrow", "safetensors", "transformers", "torch.nn.attention.flex_attention", "kernels.shared_prompt",
            "periodic_async.train.trainer", "periodic_async.reward.gsm8k"):
    try:
        __import__(mod)
    except Exception as e:  # noqa: BLE001
        print(f"ERROR: import {mod}: {type(e).__name__}: {e}")
        ok = False
print("imports ok" if ok else "SETUP FAILED")
sys.exit(0 if ok else 1)
EOF
vrc=$?
cat "$WORK/versions.txt" | tee -a "$SETUP_LOG" | sed 's/^/  /'
(( vrc == 0 )) || { setup_ok=0; setup_note+="version/import check failed (setup.log); "; }
NGPU=$(awk '/^torch.version.cuda/ { for (i = 1; i <= NF; i++) if ($i == "devices") print $(i + 1) }' "$WORK/versions.txt")
NGPU=${NGPU:-0}
record "setup" "$([[ $setup_ok == 1 ]] && echo pass || echo fail)" "$(( $(date +%s) - T0 ))" "-" \
  "${setup_note}$(grep -E '^(torch|transformers|megatron-core) ' "$WORK/versions.txt" | tr '\n' ' ')"
if [[ "$BACKEND" == cuda && "$NGPU" == 0 ]]; then
  say "setup: no usable CUDA GPU; the cuda steps will fail"
fi

# ---------------------------------------------------------------------- the steps
TRAIN=("$PY" -m periodic_async --backend "$BACKEND" --config configs/default.yaml
       trainer.progress_bar=false trainer.tensorboard=false)
if [[ "$BACKEND" == cpu ]]; then   # the dry run: plumbing only
  S_BF16=3; S_DEFAULT=3; S_LARGE=2
  LARGE_MODEL=(model.tiny.hidden_size=128 model.tiny.num_layers=2 model.tiny.num_heads=2 model.tiny.num_kv_heads=1
               model.tiny.ffn_hidden_size=256 rollout.max_new_tokens=8)
  DEFAULT_STEPS=(trainer.total_steps=$S_DEFAULT)
else
  S_BF16=100; S_LARGE=12
  # ~135M parameters (hidden 1024, 12 layers, 16 heads / 4 KV, head_dim 64, ffn 2816; char vocab)
  LARGE_MODEL=(model.tiny.hidden_size=1024 model.tiny.num_layers=12 model.tiny.num_heads=16 model.tiny.num_kv_heads=4
               model.tiny.ffn_hidden_size=2816 rollout.max_new_tokens=32 rollout.max_slots=256 actor.lr=1.0e-5)
  DEFAULT_STEPS=()                  # the default job as it is: 300 steps
fi
# One GPU: periodic / sync_split put the trainer on GPU 0 and each rollout worker on a GPU of its own
# (backend.rollout_placements), so they need 2; sync colocates the HF rollout engine with the trainer.
if [[ "$BACKEND" == cuda && "$NGPU" -ge 2 ]]; then MODE=(); else MODE=(trainer.mode=sync); fi

run_step cuda_tests 150 60 pytest "$WORK/cuda_tests.xml" -- \
  "$PY" -m pytest tests/test_shared_prompt.py -q -rs -k cuda -p no:cacheprovider --junitxml="$WORK/cuda_tests.xml"

run_step bf16_master 150 60 train "$WORK/bf16_master" -- \
  "${TRAIN[@]}" trainer.mode=sync model.dtype=bfloat16 actor.fp32_master_weights=true \
  trainer.total_steps=$S_BF16 trainer.run_dir="$WORK/bf16_master" trainer.save_final=false

run_step default_job 200 60 train "$WORK/default_job" -- \
  "${TRAIN[@]}" "${MODE[@]}" "${DEFAULT_STEPS[@]}" trainer.run_dir="$WORK/default_job"

if [[ "$BACKEND" == cuda && "$NGPU" -lt 2 ]]; then
  run_step periodic_1gpu 60 30 expect "need [0-9]+ cuda devices" -- \
    "${TRAIN[@]}" trainer.total_steps=1 trainer.run_dir="$WORK/periodic_1gpu"
fi

run_step large 100 90 train "$WORK/large" -- \
  "${TRAIN[@]}" trainer.mode=sync model.dtype=bfloat16 "${LARGE_MODEL[@]}" \
  trainer.total_steps=$S_LARGE trainer.run_dir="$WORK/large" trainer.save_final=false

run_step large_shared 100 90 train "$WORK/large_shared" -- \
  "${TRAIN[@]}" trainer.mode=sync model.dtype=bfloat16 "${LARGE_MODEL[@]}" actor.shared_prompt=true \
  trainer.total_steps=$S_LARGE trainer.run_dir="$WORK/large_shared" trainer.save_final=false

# ---------------------------------------------------------------------- summary
commit="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
gpu="$(grep -E '^gpu ' "$WORK/versions.txt" | head -1 | cut -c5-)"
header="## GPU check ($BACKEND backend$([[ -n "$gpu" ]] && echo ", $gpu"))

$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit, $(( $(date +%s) - T0 )) s in all (budget ${BUDGET} s); \`tools/gpu_check.sh\`
$(grep -E '^(python|torch|triton|transformers|megatron-core) ' "$WORK/versions.txt" | tr '\n' ';' | sed 's/;$//; s/;/; /g')

tokens/s: perf/throughput (prompt + response tokens per second per device), mean over steps 2..N;
one GPU: trainer.mode=sync (the rollout engine shares the trainer's GPU)."
echo
say "summary ($OUT/summary.md):"
"$PY" "$WORK/report.py" summary "$RESULTS" "$OUT/summary.md" "$header"
exit $?
