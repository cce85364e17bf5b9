#!/usr/bin/env bash
# Set up, then train the tiny llama3 on 2 CPU processes through torchtitan with FlexDeMo syncing the
# two replicas (R = 2): prints loss and bytes sent; TensorBoard logs under outputs/quickstart/tb.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OPTIMIZER="${OPTIMIZER:-FlexDeMo}"
# python -m titan_commopt.run = torchrun that checks the config first (a bad value: one line, exit 2)
# and shows rank 0's log alone (torchrun's --tee 3, before -m, shows every rank's).
OMP_NUM_THREADS=1 .venv/bin/python -m titan_commopt.run --nproc_per_node=2 \
  -m titan_commopt.train --job.config_file train_configs/debug_cpu.toml \
  --parallelism.data_parallel_replicate_degree 2 --optimizer.name "$OPTIMIZER" \
  --job.dump_folder outputs/quickstart "$@"
echo "TensorBoard: .venv/bin/tensorboard --logdir outputs/quickstart/tb"
