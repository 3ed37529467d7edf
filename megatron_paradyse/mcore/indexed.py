"""megatron-core's indexed datasets (``.bin``/``.idx``), which the data layer reads and writes
(:mod:`megatron_paradyse.data.indexed`) so that its files move freely to ``GPTDataset`` and back."""

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

__all__ = ["DType", "IndexedDataset", "IndexedDatasetBuilder"]
