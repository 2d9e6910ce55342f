#!/usr/bin/env bash
# One node's torchrun of a multi-node launch; train_slurm.sbatch runs it once per node (srun).
#   NODE_SIZES   ranks on each node, in node-rank order: "1,8,8" puts rank 0 (the image encoder)
#                alone on node 0 and ranks 1-8, 9-16 (the language model) on nodes 1 and 2
#   NODE_RANK    this node's index (default: Slurm's SLURM_NODEID)
#   MASTER_ADDR  node 0's address; MASTER_PORT a port free there
# Static rendezvous (torchrun's --node-rank): torch's agents give node k the global ranks after
# those of nodes 0..k-1, whatever their sizes. A c10d rendezvous would number the nodes by host
# name and process id instead, so the 1-rank node need not come first.
# Usage: NODE_SIZES=1,8,8 NODE_RANK=0 MASTER_ADDR=host MASTER_PORT=29500 \
#          bash torchrun_node.sh SCRIPT [ARGS...]
set -euo pipefail
IFS=, read -r -a sizes <<< "${NODE_SIZES:?set NODE_SIZES to the ranks per node, e.g. 1,8,8}"
node_rank="${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (or run under srun)}}"
if (( node_rank >= ${#sizes[@]} )); then
  echo "torchrun_node.sh: NODE_RANK $node_rank is not a node of NODE_SIZES=$NODE_SIZES" \
       "(${#sizes[@]} nodes); give each node a rank from 0 to $(( ${#sizes[@]} - 1 ))" >&2
  exit 2
fi
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes "${#sizes[@]}" \
  --node-rank "$node_rank" --nproc-per-node "${sizes[$node_rank]}" --rdzv-backend static \
  --master-addr "${MASTER_ADDR:?set MASTER_ADDR to node 0s address}" \
  --master-port "${MASTER_PORT:?set MASTER_PORT to a free port on node 0}" "$@"
