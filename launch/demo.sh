#!/usr/bin/env bash
# The README's main command: a traced HSDP training run of 2 replica groups x 2 ranks on Gloo
# through commslayer, where replica group 1 is SIGKILLed at step 10, the other goes on, and the
# restarted group heals from it and rejoins; then the same run without the fault is compared,
# and the traces are summarized. Options after the script go to launch/train.py.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
RUN="${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
KILL="${KILL:-1:10:allreduce}"
launch() { commslayer-run --replicas 2 --nproc-per-replica 2 "$@"; }

python launch/train.py --check-kill 2x2 --kill "$KILL" "$@" || exit 2  # a KILL that would never fire: before the runs

echo "== 1/3 fault-free reference run -> $RUN/clean"
launch --run-dir "$RUN/clean" launch/train.py "$@" | grep -E "^(coordinator|summary)|done:"
echo
echo "== 2/3 the same run; replica group ${KILL%%:*} is SIGKILLed at step $(cut -d: -f2 <<<"$KILL") ($(cut -d: -f3 <<<"$KILL")) -> $RUN/fault"
status=0
launch --run-dir "$RUN/fault" --compare-to "$RUN/clean" launch/train.py --kill "$KILL" "$@" || status=$?
echo
echo "== 3/3 what the traces say (every rank's flight recorder, $RUN/fault/traces)"
commslayer-trace summary "$RUN/fault/traces" | head -40
commslayer-trace diagnose "$RUN/fault/traces" || true
commslayer-trace export --perfetto "$RUN/fault/trace.perfetto.json" "$RUN/fault/traces"
commslayer-trace view "$RUN/fault/traces" -o "$RUN/fault/trace.html"
echo
echo "Perfetto trace: $RUN/fault/trace.perfetto.json (open in https://ui.perfetto.dev)"
echo "HTML view:      $RUN/fault/trace.html"
echo "Restarted replica group's traces: $RUN/fault/traces/replica*-restart*/"
exit $status
