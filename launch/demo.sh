#!/usr/bin/env bash
# The README's main command: a 4-rank FSDP2 training run on commslayer.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --nproc-per-node "${NPROC:-4}" --master-port "${MASTER_PORT:-29561}" launch/train.py "$@"
