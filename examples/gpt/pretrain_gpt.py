"""Stock Megatron GPT pretraining through megatron-core's own pretrain(), with mock data.

The plain reference run for megatron-plugins: nothing of the plugin set is involved except the
explicit wheel bridge and, with ``--cpu-simulation``, the CPU simulation of the stock loop.
"""

import sys

from megatron_plugins import cpu_simulation

if cpu_simulation.FLAG in sys.argv:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()

from functools import partial  # noqa: E402

import torch  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils.common_utils import is_first_or_last_pipeline_stage  # noqa: E402

from megatron_plugins.compat import startup  # noqa: E402


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss and token count, the stock per-token reduction."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """One micro-batch through the GPT model."""
    tokens = labels = loss_mask = attention_mask = position_ids = None
    if is_first_or_last_pipeline_stage(None):
        batch = {key: value.cuda(non_blocking=True) for key, value in next(data_iterator).items()}
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        attention_mask, position_ids = batch.get("attention_mask"), batch["position_ids"]
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock GPT datasets, built on the ranks that read data."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        blend_per_split=None,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )

    # Every tensor-parallel rank reads the same deterministic samples, so no broadcast is needed.
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        train_val_test_num_samples,
        partial(is_first_or_last_pipeline_stage, vp_stage),
        config,
    ).build()


datasets_provider.is_distributed = True


def build_config():
    """Parse stock flags from ``sys.argv`` into the config container stock pretrain() takes."""
    args = parse_and_validate_args(extra_args_provider=cpu_simulation.add_cli_flag)
    return pretrain_cfg_container_from_args(args, gpt_config_from_args(args))


def main() -> None:
    startup.install()
    pretrain(build_config(), datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
