"""The documents of a job: its dataset (a built-in corpus, built on first use, or Megatron's ``.bin``/``.idx``
files), the subset the config draws, and the training, validation and test splits ``--split`` makes
of it, the same on every rank."""

from __future__ import annotations

from megatron_paradyse.config import ParadyseConfig
from megatron_paradyse.data import DocumentDataset
from megatron_paradyse.data.corpora import build_code_corpus, build_dna_corpus
from megatron_paradyse.data.subset import DocumentSubset, split_documents, split_fractions, spread_by_length

__all__ = ["BUILT_IN", "build_corpus", "open_documents", "split_for_training", "split_source", "training_documents"]


BUILT_IN = ("code", "dna")
"""The corpora ``data.dataset`` may name instead of a path (``paradyse build-corpus``)."""


def build_corpus(config: ParadyseConfig, *, build: bool = True) -> str:
    """The prefix of the built-in corpus ``data.dataset``, built into ``data.cache_dir`` if it is not there
    (``build=False``: :class:`~megatron_paradyse.data.corpora.NotBuilt` instead)."""
    data = config.data
    if data.dataset == "code":
        return build_code_corpus(data.cache_dir, build=build)
    return build_dna_corpus(
        data.cache_dir, num_sequences=data.dna_sequences, max_len=data.max_len, seed=data.seed, build=build
    )


def open_documents(config: ParadyseConfig, *, build: bool = True):
    """(the documents the job draws its splits from, the whole dataset they come from): ``data.dataset``
    (a built-in corpus built into ``data.cache_dir`` if it is not there, as :func:`build_corpus` with
    ``build``), ``data.num_documents`` of it spread over lengths where that is set."""
    data = config.data
    # at start-up, built by then: this only resolves (and checks) the cached prefix
    dataset = DocumentDataset(build_corpus(config, build=build) if data.dataset in BUILT_IN else data.dataset)
    if not (dataset.lengths >= _TRAINABLE).any():
        raise ValueError(
            f"the dataset {dataset.path_prefix}: each of its {len(dataset)} documents is shorter than {_TRAINABLE} "
            f"tokens, and a token is learnt from the one before it: there is nothing to train on"
        )
    if data.num_documents is None:
        return dataset, dataset
    docs = spread_by_length(dataset.lengths, data.num_documents, data.min_len, data.max_len)
    return DocumentSubset(dataset, docs), dataset


def training_documents(config: ParadyseConfig, args, vocab_size: int, *, build: bool = True) -> dict:
    """The documents of training, validation and test (:func:`split_for_training`) of the dataset the
    config names (:func:`open_documents`, ``build`` as there), its token ids checked against the
    tokenizer's ``vocab_size``: what a job opens and checks at start-up, and ``paradyse check-config``
    before it."""
    documents, whole = open_documents(config, build=build)
    whole.check_token_ids(vocab_size)
    return split_for_training(documents, args, config.data.seed)


_TRAINABLE = 2
"""Tokens a document needs to train on: one to predict from, one to predict."""

_DEFAULT_VALIDATION = 0.02
"""Without ``--split``, validation takes this fraction of the documents (at least one), test none."""


def split_for_training(documents, args, seed: int) -> dict:
    """The documents of training, validation and test, as ``--split`` shares them (every rank alike).
    Without ``--split`` and without evaluation (``--eval-iters 0``) all train."""
    if args.split is None and not args.eval_iters:
        return {"train": documents, "valid": None, "test": None}
    n = len(documents.lengths)
    if args.split is None:
        held = max(1, round(_DEFAULT_VALIDATION * n))
        fractions = ((n - held) / n, held / n, 0.0)
    else:
        fractions = split_fractions(args.split)
    parts = dict(zip(("train", "valid", "test"), split_documents(n, fractions, seed)))
    needed = ["train"] + ["valid"] * bool(args.eval_iters)
    empty = [name for name in needed if not (documents.lengths[parts[name]] >= _TRAINABLE).any()]
    if empty:
        raise ValueError(
            f"{split_source(args)} of {n} documents leaves none of {_TRAINABLE} tokens or more for "
            f"{' and '.join(empty)}: give that split a larger share (--split), or use more documents "
            f"(data.num_documents)"
        )
    return {name: DocumentSubset(documents, docs) if len(docs) else None for name, docs in parts.items()}


def split_source(args) -> str:
    if args.split is None:
        return f"the default split, {_DEFAULT_VALIDATION:.0%} of the documents for validation (at least one)"
    return f"--split {args.split}"
