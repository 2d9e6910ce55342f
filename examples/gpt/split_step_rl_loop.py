"""An RL-style loop over stock GPT with the split train step: each data-parallel replica feeds a
different number of microbatches per step, as rollouts arrive, and some steps are abandoned.

Stock flags as for examples/gpt/pretrain_gpt.py, plus ``--calculate-per-token-loss``; e.g.

    torchrun --nproc-per-node 2 examples/gpt/split_step_rl_loop.py --cpu-simulation \\
        --calculate-per-token-loss --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 \\
        --global-batch-size 8 --train-iters 6 --lr 1e-3 --tokenizer-type NullTokenizer \\
        --vocab-size 128 --mock-data --transformer-impl local --no-gradient-accumulation-fusion \\
        --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \\
        --no-rope-fusion --no-persist-layer-norm --distributed-backend gloo --eval-iters 0 --eval-interval 1000

Stock ``pretrain()`` builds the model, optimizer, scheduler and data; its training loop is
replaced by :func:`rl_loop` (an RL trainer would build them the same way and call its own loop).
"""

import random
import sys
from functools import partial

from megatron_plugins import cpu_simulation

if cpu_simulation.FLAG in sys.argv:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()

import megatron.training.training as training  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402

from megatron_plugins.compat import startup  # noqa: E402
from megatron_plugins.step.split import SplitTrainStep  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import pretrain_gpt  # noqa: E402


def rollout(data_iterator):
    """The next microbatch (middle pipeline stages read no data)."""
    return next(data_iterator) if data_iterator is not None else None


def rl_loop(forward_step_func, model, optimizer, scheduler, train_data_iterator, *_, **schedule):
    """Steps of variable size per replica; every third step is abandoned after one rollout."""
    args = get_args()
    step = SplitTrainStep(model, optimizer, scheduler, forward_step_func,
                          p2p_communicator=schedule.get("p2p_communicator"),
                          pg_collection=schedule.get("pg_collection"))
    # Every tensor / pipeline rank of a replica must feed the same number of microbatches.
    rollouts = random.Random(1000 + parallel_state.get_data_parallel_rank())
    for iteration in range(1, args.train_iters + 1):
        step.begin("tokens")
        if iteration % 3 == 0:
            step.microbatch(rollout(train_data_iterator))
            step.abort()  # e.g. the policy moved on: drop the stale rollout, nothing changes
            continue
        for _ in range(rollouts.randint(1, 2)):
            step.microbatch(rollout(train_data_iterator))
        metrics = step.finish()
        if dist.get_rank() == 0:
            print(f"step {iteration}: loss {metrics.loss:.4f} over {metrics.count} tokens in "
                  f"{metrics.microbatches} microbatches, grad norm {metrics.grad_norm:.3f}",
                  flush=True)
    return args.train_iters, 0.0


def main() -> None:
    startup.install()
    training.train = rl_loop
    pretrain(pretrain_gpt.build_config(), pretrain_gpt.datasets_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step)


if __name__ == "__main__":
    main()
