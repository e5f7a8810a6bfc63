#!/usr/bin/env bash
# Fault tolerance end to end, on a CPU in about 20 seconds (2 idle cores):
#
#     bash examples/fault_tolerance_demo.sh [WORK_DIR]        # WORK_DIR: a fresh temp dir if omitted
#
# 1. A reference run (hookloop train examples/configs/gpt_tiny.yaml, a smaller model) trains 80
#    steps without interruption. A NaN burst is injected on purpose (fault_injection.kind=nan: the
#    loss of microbatches 80-85, i.e. steps 41-43, is NaN), so the NaN detector vetoes those steps
#    and rolls back to the step-40 checkpoint.
# 2. The same run again, in another directory, is killed with SIGKILL (kill -9) once its step-20
#    checkpoint is complete: no clean shutdown, a save may be half written.
# 3. Started again with the same command, it resumes from its newest complete checkpoint, meets the
#    NaN burst, rolls back, skips the poisoned data and trains to step 80.
# 4. The final loss of the killed-and-resumed run must equal the reference run's, bit for bit
#    (deterministic algorithms, one thread). The script exits 0 when they are equal, 1 when not.
#
# Each run's full output is in WORK_DIR/<run>.log; PYTHON picks the interpreter (default python).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d "${TMPDIR:-/tmp}/fault_demo.XXXXXX")}"
PY="${PYTHON:-python}"
mkdir -p "$WORK"
export OMP_NUM_THREADS=1
CONFIG="$REPO/examples/configs/gpt_tiny.yaml"

ARGS=(
  "data.cache_dir=$WORK/data" model.n_layers=2 model.d_model=64
  step_scheduler.max_steps=80 step_scheduler.ckpt_every_steps=20 lr.decay_steps=80
  logging.log_interval=10 train.deterministic=true train.num_threads=1
  nan.max_consecutive=3 fault_injection.enabled=true fault_injection.kind=nan
  "fault_injection.microbatches=[80,81,82,83,84,85]"
)
train() {  # train <run name> ...: hookloop train CONFIG in WORK_DIR/<run name>
  local name="$1"
  shift
  "$PY" -m hookloop train "$CONFIG" "train.run_dir=$WORK/$name" "${ARGS[@]}" "$@"
}
show() {  # the lifecycle lines of a log: resume, NaN steps, rollback, checkpoints, the end
  grep -E "resumed from|step skipped|rolling back|rolled back|checkpoint of step|^done:" "$1" | sed 's/^/    /' || true
}
final_loss() {  # the loss logged at the last step (JSON keeps every bit of the float)
  "$PY" - "$1/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(repr([r["loss"] for r in rows if r.get("step") == 80 and "loss" in r][-1]))
EOF
}

echo "== 1. reference run: 80 steps, NaN burst at steps 41-43, never interrupted"
train reference >"$WORK/reference.log" 2>&1
show "$WORK/reference.log"

echo "== 2. the same run, killed with SIGKILL once its step-20 checkpoint is complete"
"$PY" -m hookloop train "$CONFIG" "train.run_dir=$WORK/demo" "${ARGS[@]}" >"$WORK/demo_killed.log" 2>&1 &
pid=$!  # the training process itself, so kill -9 hits it and nothing else
latest="$WORK/demo/checkpoints/latest"
for _ in $(seq 1 1200); do  # at most 2 minutes
  if [[ -f "$latest" && "$(cat "$latest")" != "step_00000000" ]]; then break; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
if ! kill -0 "$pid" 2>/dev/null; then
  echo "the run ended before it could be killed; see $WORK/demo_killed.log" >&2
  exit 1
fi
kill -9 "$pid"
status=0
{ wait "$pid"; } 2>/dev/null || status=$?  # (bash's own "Killed" notice silenced)
reached=$(grep -o '"step": *[0-9]*' "$WORK/demo/metrics.jsonl" 2>/dev/null | tail -1 | tr -dc 0-9 || true)
echo "    killed (exit status $status, SIGKILL) after logging step ${reached:-0}; newest complete checkpoint: $(cat "$latest")"
show "$WORK/demo_killed.log"

echo "== 3. the same command again: resume, NaN burst, rollback, on to step 80"
train demo >"$WORK/demo_resumed.log" 2>&1
show "$WORK/demo_resumed.log"

echo "== 4. verdict"
reference=$(final_loss "$WORK/reference")
resumed=$(final_loss "$WORK/demo")
echo "    final loss, uninterrupted run:             $reference"
echo "    final loss, killed, resumed, rolled back:  $resumed"
if [[ "$reference" == "$resumed" ]]; then
  echo "PASS: the final losses are bitwise equal"
else
  echo "FAIL: the final losses differ" >&2
  exit 1
fi
