#!/usr/bin/env bash
# The README's main command: a traced 4-rank FSDP2 training run on commslayer.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every rank records its collectives and dumps them here at exit (docs/trace-format.md).
export COMMSLAYER_TRACE_DIR="${COMMSLAYER_TRACE_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)/traces}"
echo "traces: $COMMSLAYER_TRACE_DIR"
exec torchrun --nproc-per-node "${NPROC:-4}" --master-port "${MASTER_PORT:-29561}" launch/train.py "$@"
