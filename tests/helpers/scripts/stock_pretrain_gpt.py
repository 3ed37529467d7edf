"""Megatron-LM's stock ``pretrain_gpt.py`` (tag core_v0.19.0), reduced to a GPT on Megatron's own datasets,
for the tests: its ``get_batch`` (TP rank 0 reads, then broadcasts), ``loss_func`` and ``forward_step``
as the stock script has them, Megatron's ``GPTDataset``/``MockGPTDataset`` through
``BlendedMegatronDatasetBuilder``, and ``megatron.training.pretrain``. No megatron-paradyse code runs
but what ``--spec`` names (and, on a machine without CUDA, :mod:`megatron_paradyse.mcore.compat`, which the
patch in ``patches/`` also installs into the stock script; and, unlike the stock script, on its way out
:func:`megatron_paradyse.run.startup.leaving_process_groups`).

    torchrun --nproc-per-node 2 tests/stock_pretrain_gpt.py --mock-data --spec megatron_paradyse.spec \\
        get_paradyse_layer_spec --tensor-model-parallel-size 2 --sequence-parallel ...
"""

from megatron_paradyse.mcore import compat

compat.install()

from functools import partial  # noqa: E402

import torch  # noqa: E402

from megatron_paradyse.run.startup import leaving_process_groups  # noqa: E402

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split  # noqa: E402

BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "labels", "loss_mask", "max_seqlen"]
BATCH_KEYS += ["position_ids", "tokens"]


def get_batch(data_iterator):
    args = get_args()
    has_cu_seqlens = args.sft or args.dataloader_inter_document_masking
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            batch[key] = batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None
    batch = get_batch_on_this_tp_rank(
        batch,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        has_cu_seqlens=has_cu_seqlens,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=1,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    args = get_args()
    attention_mask, cu_seqlens, cu_seqlens_padded, labels, loss_mask, max_seqlen, position_ids, tokens = get_batch(
        data_iterator
    )
    packed_seq_params = None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.squeeze(0)
        if cu_seqlens_padded is not None:
            cu_seqlens_padded = cu_seqlens_padded.squeeze(0)
        cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        packed_seq_params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_seqlens_padded,
            cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=int(max_seqlen.item()),
            max_seqlen_kv=int(max_seqlen.item()),
            tokens_per_sample=args.seq_length,
        )
    output_tensor = model(
        tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, packed_seq_params=packed_seq_params
    )
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        inter_document_masking=args.dataloader_inter_document_masking,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()


if __name__ == "__main__":
    # A Megatron-LM checkout compiles its dataset helpers with make; the megatron-core wheel ships them
    # compiled, without the Makefile (megatron_paradyse.pretrain_gpt does the same).
    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None
    train_valid_test_datasets_provider.is_distributed = True
    # leaving_process_groups: PyTorch's documented shutdown, which the stock script leaves to the
    # interpreter's exit, where a gloo group still alive can abort a finished rank (seen in CI)
    with compat.megatron_training_on_cpu(), leaving_process_groups():
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        pretrain(
            pretrain_cfg_container_from_args(args, gpt_config_from_args(args)),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
