#!/usr/bin/env bash
# The one script for a GPU session: check and time the Pallas kernels, then
# measure training throughput.
#
#   OUT=$OUT bash benchmarks/gpu_check.sh   # from the repository root, ~3-5 min on one H200
#   QUICK=1 bash benchmarks/gpu_check.sh    # each kernel's default config only, smaller probe
#   CPU_SMOKE=1 bash benchmarks/gpu_check.sh  # every stage on the CPU, tiny (numbers meaningless)
#
# 1. prints the GPU, python and jax versions;
# 2. makes `zeropp_jax` and `pallas_kernels` importable from this tree
#    (PYTHONPATH; `pip install --no-deps --no-build-isolation -e .` only if
#    that is not enough - nothing is fetched from the network); if they still
#    do not import, prints the whole error and goes on (each stage then says
#    what failed);
# 3. runs the compiled half of tests/test_pallas_kernels.py
#    (PALLAS_KERNELS_COMPILED=1, `-k compiled`): every kernel compiled for the
#    GPU against its reference run by XLA on the GPU; the interpret-mode half
#    runs on CPU in CI. pyproject's addopts are left out (`-o addopts=`): they
#    name pytest-xdist options, and this needs no plugin;
# 4. runs benchmarks/gpu_kernels.py (verification on the GPU, then GB/s of
#    each kernel's default config and of a sweep, vs XLA vs a device copy;
#    the sweep's best config verified too);
# 5. runs benchmarks/gpu_train_probe.py (1.2B example GPT, bf16: plain jit,
#    plain with per-layer remat, zero3, qwz with its default kernels, with
#    Pallas only and with XLA only), saving each variant's optimized HLO
#    ($OUT/hlo.tgz: `tar xzf` it, then benchmarks/step_traffic.py --hlo-dir
#    hlo on any machine) and its device time per kernel from a profiler trace
#    of two more steps ($OUT/profile.tgz: profile/<variant>.json, for
#    plain_remat, zero3 and qwz);
# 6. prints a short summary last: the pytest result line, both tables and
#    whether the step meets issue 18's goals (one "goal met / NOT met" line
#    each). A stage cut short by its time limit still gets its table, from the
#    JSON it wrote after each kernel or variant.
#
# What it leaves in $OUT (the device tool's output folder; /tmp/zeropp_gpu_check
# without one) is 7 files, since the device tool brings back at most 8:
# pytest.log, bench.log, probe.log, gpu_kernels.json, gpu_train_probe.json,
# hlo.tgz, profile.tgz. Each stage has its own time limit (the sum about 8
# minutes plus start-up), so a hanging stage costs its limit, not the session:
# give the device tool's run a timeout_s of about 560. A 15-minute session
# (machine start included) has room for a rerun only after a typical run (3-5
# min): make it QUICK=1 on the warm machine. No GPU visible to JAX stops the
# script right after the environment line (exit 3): its stages would measure
# nothing and end 0.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
LOG_DIR="${OUT:-/tmp/zeropp_gpu_check}"
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/{pytest.log,bench.log,probe.log,gpu_kernels.json,gpu_train_probe.json,hlo.tgz,profile.tgz}
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# GPU first (the default backend), CPU for the interpret-mode tests.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
TEST_TIMEOUT="${TEST_TIMEOUT:-100}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
PROBE_TIMEOUT="${PROBE_TIMEOUT:-230}"
KILL_AFTER=10  # seconds between a limit's SIGTERM and its SIGKILL
WORK_DIR="$(mktemp -d)"  # HLO and profiles, before they are packed into two files
trap 'rm -rf "$WORK_DIR"' EXIT
TEST_SELECT=compiled
BENCH_ARGS=(--json-out "$LOG_DIR/gpu_kernels.json")
PROBE_ARGS=(--json-out "$LOG_DIR/gpu_train_probe.json" --hlo-dir "$WORK_DIR/hlo"
            --profile-dir "$WORK_DIR/profile")
if [[ "${QUICK:-0}" == "1" ]]; then
  BENCH_ARGS+=(--quick)
  PROBE_ARGS+=(--layers 12 --d-model 768 --heads 12)
fi
if [[ "${CPU_SMOKE:-0}" == "1" ]]; then  # the script's own check (tests/test_step_tools.py)
  export JAX_PLATFORMS=cpu
  TEST_SELECT="interpret and decode_by_bits"
  BENCH_ARGS+=(--cpu-smoke --quick --elems 131072 --repeats 1 --batch 1 --only "int8 f32")
  PROBE_ARGS+=(--allow-cpu --layers 2 --d-model 64 --heads 4 --seq 32 --batch 2
               --variants plain_remat,zero3 --warmup 1 --steps 1 --repeats 1)
fi

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem \
  --format=csv,noheader 2>&1 | head -n 4
"$PY" - <<'EOF'
import sys
import jax
print("python", sys.version.split()[0], "| jax", jax.__version__, "| backend", jax.default_backend(),
      "|", [d.device_kind for d in jax.devices()])
EOF
if [[ "${CPU_SMOKE:-0}" != "1" ]] && \
   [[ "$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" != "gpu" ]]; then
  echo "no GPU: JAX's backend is not gpu, so no stage would measure anything (the"
  echo "benchmarks say 'No GPU' and exit 0); stopping here (CPU_SMOKE=1 runs them on the CPU)"
  exit 3
fi

echo "== imports"
if ! "$PY" -c "import zeropp_jax, pallas_kernels" 2>"$WORK_DIR/import.err"; then
  echo "not importable from the tree ($(tail -n 1 "$WORK_DIR/import.err")); trying an editable install"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || true
  if ! "$PY" -c "import zeropp_jax, pallas_kernels" 2>"$WORK_DIR/import.err"; then
    echo "cannot import the packages; the stages below will fail and say where:"
    cat "$WORK_DIR/import.err"
  fi
else
  echo "ok"
fi

echo "== tests (compiled on GPU), limit ${TEST_TIMEOUT}s"
PALLAS_KERNELS_COMPILED=1 timeout -k "$KILL_AFTER" "$TEST_TIMEOUT" "$PY" -m pytest -q \
  -o addopts= -p no:cacheprovider tests/test_pallas_kernels.py -k "$TEST_SELECT" -rfE 2>&1 \
  | tee "$LOG_DIR/pytest.log"
TEST_RC=${PIPESTATUS[0]}

echo "== benchmark, limit ${BENCH_TIMEOUT}s"
timeout -k "$KILL_AFTER" "$BENCH_TIMEOUT" "$PY" benchmarks/gpu_kernels.py "${BENCH_ARGS[@]}" 2>&1 \
  | tee "$LOG_DIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== training probe, limit ${PROBE_TIMEOUT}s"
timeout -k "$KILL_AFTER" "$PROBE_TIMEOUT" "$PY" benchmarks/gpu_train_probe.py "${PROBE_ARGS[@]}" 2>&1 \
  | tee "$LOG_DIR/probe.log"
PROBE_RC=${PIPESTATUS[0]}
for part in hlo profile; do  # one file each: the device tool brings back at most 8
  if [[ -d "$WORK_DIR/$part" ]]; then tar czf "$LOG_DIR/$part.tgz" -C "$WORK_DIR" "$part"; fi
done

# A stage's table: the lines after its JSON line, or, where a limit cut it
# short before printing them, the table of the JSON it kept.
table() {  # LOG SCRIPT JSON_FILE
  if grep -q '^JSON ' "$1"; then
    sed -n '/^JSON /,$p' "$1" | tail -n +2
  elif [[ -s "$3" ]]; then
    echo "(cut short: the table of what it measured before)"
    "$PY" "$2" --table-from "$3"
  else
    echo "(no results)"
  fi
}

echo
echo "== summary"
echo "pytest (rc=$TEST_RC): $(grep -E '(passed|failed|error|deselected)' "$LOG_DIR/pytest.log" | tail -n 1)"
grep -E '^FAILED|^ERROR' "$LOG_DIR/pytest.log" | head -n 12
echo "kernels (rc=$BENCH_RC):"
table "$LOG_DIR/bench.log" benchmarks/gpu_kernels.py "$LOG_DIR/gpu_kernels.json"
echo "training probe (rc=$PROBE_RC):"
table "$LOG_DIR/probe.log" benchmarks/gpu_train_probe.py "$LOG_DIR/gpu_train_probe.json"
echo "files in $LOG_DIR: $(find "$LOG_DIR" -type f | wc -l) (the device tool brings back 8 at most)"
if [[ $TEST_RC -ne 0 || $BENCH_RC -ne 0 || $PROBE_RC -ne 0 ]]; then exit 1; fi
