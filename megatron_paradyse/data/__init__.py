"""The dynamic-sequence data pipeline: indexed datasets, samplers, packing, canonical order, DP balance.

- :mod:`~megatron_paradyse.data.indexed`: Megatron ``.bin``/``.idx`` files, checked, read and written
  through megatron-core.
- :mod:`~megatron_paradyse.data.prepare`, :mod:`~megatron_paradyse.data.corpora`: text -> dataset; the
  built-in code (CPython stdlib) and synthetic-DNA corpora.
- :mod:`~megatron_paradyse.data.samplers`, :mod:`~megatron_paradyse.data.batching`,
  :mod:`~megatron_paradyse.data.balance`, :mod:`~megatron_paradyse.data.loader`: samples -> epoch order
  -> micro-batches (one document each, or packed) -> this DP rank's balanced share, resumable.

Command line: ``python -m megatron_paradyse.data {stats,prepare,build-corpus,balance}``.
"""

from megatron_paradyse.data.balance import DEFAULT_WORK_MODEL, WorkModel, assign_to_ranks, imbalance
from megatron_paradyse.data.batching import make_micro_batch, pack
from megatron_paradyse.data.indexed import DocumentDataset, IndexInfo, validate, write_documents
from megatron_paradyse.data.loader import DynamicSequenceLoader, GlobalBatch, LoaderConfig, MicroBatchSampler
from megatron_paradyse.data.samplers import Spans, epoch_order
from megatron_paradyse.data.tokenizers import ByteTokenizer, KmerTokenizer, get_tokenizer

__all__ = [
    "DEFAULT_WORK_MODEL",
    "ByteTokenizer",
    "DocumentDataset",
    "DynamicSequenceLoader",
    "IndexInfo",
    "KmerTokenizer",
    "LoaderConfig",
    "MicroBatchSampler",
    "Spans",
    "GlobalBatch",
    "WorkModel",
    "assign_to_ranks",
    "epoch_order",
    "get_tokenizer",
    "imbalance",
    "make_micro_batch",
    "pack",
    "validate",
    "write_documents",
]
