"""The loader's invariants: samples, epoch orders, packing, micro-batch tensors, DP balance, resumption;
the built-in corpora and the command line."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.data.__main__ import main
from megatron_paradyse.data.balance import WorkModel, assign_to_ranks, imbalance, rank_loads
from megatron_paradyse.data.batching import make_micro_batch, pack
from megatron_paradyse.data.corpora import GRCH38_SHARES, build_code_corpus, build_dna_corpus
from megatron_paradyse.data.indexed import DocumentDataset, write_documents
from megatron_paradyse.data.loader import DynamicSequenceLoader, LoaderConfig, MicroBatchSampler, StreamPosition
from megatron_paradyse.data.samplers import Spans, epoch_order
from megatron_paradyse.data.stats import length_histogram

SAMPLERS = ("random", "bucketed", "curriculum")


def long_tailed_lengths(n: int, seed: int = 0, max_len: int = 512) -> np.ndarray:
    return np.minimum(np.random.default_rng(seed).lognormal(4.0, 1.2, size=n).astype(np.int64) + 2, max_len)


def small_config(sampler: str, token_budget: int | None, micro_batches_per_step: int) -> LoaderConfig:
    return LoaderConfig(
        p=2,
        max_len=512,
        token_budget=token_budget,
        sampler=sampler,
        bucket_size=16,
        micro_batches_per_step=micro_batches_per_step,
    )


def epoch_streams(sampler: MicroBatchSampler, epochs: int) -> list[list[tuple[int, ...]]]:
    """The micro-batches of each of the first ``epochs`` epochs, cut from the chain of steps."""
    flat, position = [], StreamPosition(0, 0, 0)
    while position.epoch < epochs:
        batch = sampler.global_batch(position)
        flat += batch.micro_batches
        position = batch.next
    streams = []
    for epoch in range(epochs):
        n = len(sampler.epoch_micro_batches(epoch))
        streams.append(flat[:n])
        flat = flat[n:]
    return streams


def test_spans_split_and_truncate():
    lengths = np.array([0, 1, 2, 5, 9])
    split = Spans.build(lengths, max_len=4)
    # doc 3: [0,4) goes on, [4,5) is one token without a label; doc 4: [0,4) [4,8) go on, [8,9) dropped
    assert list(zip(split.doc, split.offset, split.length, split.continues)) == [
        (2, 0, 2, False),
        (3, 0, 4, True),
        (4, 0, 4, True),
        (4, 4, 4, True),
    ]
    truncated = Spans.build(lengths, max_len=4, overflow="truncate")
    assert list(zip(truncated.doc, truncated.length, truncated.continues)) == [
        (2, 2, False),
        (3, 4, True),
        (4, 4, True),
    ]
    with pytest.raises(ValueError, match="max_len must be >= 2 tokens"):
        Spans.build(lengths, max_len=1)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_epoch_order_is_a_deterministic_permutation(sampler):
    lengths = long_tailed_lengths(300)
    order = epoch_order(sampler, lengths, seed=3, epoch=1, bucket_size=16)
    assert sorted(order.tolist()) == list(range(300))
    np.testing.assert_array_equal(order, epoch_order(sampler, lengths, seed=3, epoch=1, bucket_size=16))
    assert not np.array_equal(order, epoch_order(sampler, lengths, seed=4, epoch=1, bucket_size=16))
    assert not np.array_equal(order, epoch_order(sampler, lengths, seed=3, epoch=2, bucket_size=16))
    if sampler == "curriculum":
        assert np.all(np.diff(lengths[order]) >= 0)
    if sampler == "bucketed":  # buckets hold neighbours in length order
        sorted_lengths = np.sort(lengths)
        for i in range(0, 300, 16):
            bucket = lengths[order[i : i + 16]]
            assert bucket.min() >= sorted_lengths[i] and bucket.max() <= sorted_lengths[min(i + 15, 299)]


@pytest.mark.parametrize("budget", [None, 512], ids=["unpacked", "packed"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sample_exactly_once_per_epoch(sampler, budget):
    lengths = long_tailed_lengths(300)
    config = small_config(sampler, budget, micro_batches_per_step=2)
    dp_size = 3
    samplers = [MicroBatchSampler(lengths, config, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    streams = epoch_streams(samplers[0], epochs=3)
    for stream in streams:
        assert sorted(i for mb in stream for i in mb) == list(range(300))
        if budget:
            assert all(sum(lengths[list(mb)]) <= budget for mb in stream)
        if sampler == "curriculum":
            assert np.all(np.diff([lengths[i] for mb in stream for i in mb]) >= 0)
    # Every rank computes the same steps alone, takes its share; together they run the global batch.
    position = StreamPosition(0, 0, 0)
    for _ in range(len(streams[0]) // (dp_size * 2) + 3):
        batch = samplers[0].global_batch(position)
        mine = [[next(s) for _ in range(2)] for s in samplers]
        assert sorted(mb for share in mine for mb in share) == sorted(batch.micro_batches)
        for rank, share in enumerate(mine):
            assert share == [batch.micro_batches[i] for i in batch.assignment[rank]]
        position = batch.next


@pytest.mark.parametrize("budget", [None, 512], ids=["unpacked", "packed"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_resume_yields_exactly_the_remaining_micro_batches(sampler, budget):
    lengths = long_tailed_lengths(200)
    config = small_config(sampler, budget, micro_batches_per_step=3)
    for stop in (5, 131):  # mid-step in the first epoch; past an epoch boundary
        original = MicroBatchSampler(lengths, config, dp_rank=1, dp_size=2)
        for _ in range(stop):
            next(original)
        state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint would store it
        resumed = MicroBatchSampler(lengths, config, dp_rank=1, dp_size=2)
        resumed.load_state_dict(state)
        assert list(itertools.islice(resumed, 150)) == list(itertools.islice(original, 150))
    with pytest.raises(ValueError, match=r"the run differs from the saved one \(dp_size: saved 2, now 4\)"):
        MicroBatchSampler(lengths, config, dp_rank=1, dp_size=4).load_state_dict(state)
    state["position"] = [0, 10_000, 0]
    with pytest.raises(ValueError, match=r"StreamPosition\(epoch=0, index=10000, phase=0\) is outside epoch 0"):
        MicroBatchSampler(lengths, config, dp_rank=1, dp_size=2).load_state_dict(state)


def test_bucketed_steps_hold_similar_lengths():
    lengths = long_tailed_lengths(2000)
    config = LoaderConfig(p=4, max_len=4096, sampler="bucketed", bucket_size=64, micro_batches_per_step=4)
    sampler = MicroBatchSampler(lengths, config, dp_size=4)
    position, spread = StreamPosition(0, 0, 0), []
    while position.epoch < 2:
        batch = sampler.global_batch(position)
        if batch.next.epoch == position.epoch:  # not the one step that spans two epochs
            step = [lengths[mb[0]] for mb in batch.micro_batches]
            spread.append(np.searchsorted(np.sort(lengths), max(step)) - np.searchsorted(np.sort(lengths), min(step)))
        position = batch.next
    assert max(spread) < 2 * 64  # a step's lengths are neighbours in sorted order: at most two adjacent buckets


def test_pack_is_greedy_and_keeps_order():
    lengths = np.array([5, 3, 4, 8, 1, 1, 7])
    assert pack(np.arange(7), lengths, token_budget=8) == [(0, 1), (2,), (3,), (4, 5), (6,)]
    assert pack(np.array([6, 0]), lengths, token_budget=None) == [(6,), (0,)]
    with pytest.raises(ValueError, match="sample 3 has 8 tokens, more than the token budget 7"):
        pack(np.arange(7), lengths, token_budget=7)


@pytest.mark.parametrize("causal", [True, False])
def test_micro_batch_tensors(causal):
    docs = [np.arange(100, 105), np.arange(200, 203), np.arange(300, 308)]  # the last one goes on after 7 tokens
    batch = make_micro_batch(docs, [False, False, True], p=2, causal=causal, pad_id=9, samples=(4, 0, 2))
    layout = batch["layout"]
    assert layout.doc_lengths == (5, 3, 7) and layout.padded_len == 16 and layout.causal == causal
    natural = {k: layout.from_canonical(batch[k][0], dim=0) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    assert natural["tokens"].tolist() == [*range(100, 105), *range(200, 203), *range(300, 307)]
    assert natural["labels"].tolist() == [*range(101, 105), 9, *range(201, 203), 9, *range(301, 308)]
    assert natural["loss_mask"].tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    assert natural["position_ids"].tolist() == [*range(5), *range(3), *range(7)]
    # the padding token: canonical position of natural position 15
    pad = int(layout.canonical_index[15])
    assert (batch["tokens"][0, pad], batch["labels"][0, pad], batch["loss_mask"][0, pad]) == (9, 9, 0.0)
    torch.testing.assert_close(batch["position_ids"][0], layout.position_ids)
    assert batch["tokens"].shape == batch["loss_mask"].shape == (1, 16) and batch["tokens"].dtype == torch.int64
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 15, 16] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 7 and batch["samples"] == (4, 0, 2)
    if causal:  # zigzag: rank 0 holds chunks 0 and 3 of 4, natural positions 0-3 and 12-15
        assert batch["tokens"][0, :8].tolist() == [100, 101, 102, 103, 304, 305, 306, 9]


def test_loader_reads_the_sampled_tokens(tmp_path):
    docs = [np.random.default_rng(i).integers(0, 258, size=n) for i, n in enumerate(long_tailed_lengths(60))]
    write_documents(tmp_path / "d", docs, vocab_size=258)
    config = LoaderConfig(
        p=3, max_len=96, token_budget=192, sampler="bucketed", bucket_size=8, micro_batches_per_step=2
    )
    loader = DynamicSequenceLoader(DocumentDataset(tmp_path / "d"), config, dp_rank=1, dp_size=2)
    spans = loader.spans
    for batch in itertools.islice(loader, 40):
        tokens = batch["layout"].from_canonical(batch["tokens"][0]).numpy()
        labels = batch["layout"].from_canonical(batch["labels"][0]).numpy()
        start = 0
        for i in batch["samples"]:
            doc, offset, length = spans.doc[i], spans.offset[i], spans.length[i]
            np.testing.assert_array_equal(tokens[start : start + length], docs[doc][offset : offset + length])
            n_labels = length if spans.continues[i] else length - 1
            np.testing.assert_array_equal(
                labels[start : start + n_labels], docs[doc][offset + 1 : offset + 1 + n_labels]
            )
            start += length


def test_assign_to_ranks_is_balanced_and_deterministic():
    rng = np.random.default_rng(0)
    for _ in range(20):
        works = (rng.pareto(1.5, size=8) + 1).tolist()
        assignment = assign_to_ranks(works, 2)
        assert [len(a) for a in assignment] == [4, 4] and sorted(sum(assignment, [])) == list(range(8))
        assert assignment == assign_to_ranks(works, 2)
        best = min(
            max(sum(works[i] for i in half), sum(works) - sum(works[i] for i in half))
            for half in itertools.combinations(range(8), 4)
        )
        assert rank_loads(works, assignment).max() <= 4 / 3 * best + 1e-9  # LPT's bound
    assert imbalance(rank_loads([3.0, 1.0, 2.0, 2.0], [[0, 1], [2, 3]])) == 0.0
    with pytest.raises(ValueError, match="7 micro-batches cannot be split evenly over dp_size=2 ranks"):
        assign_to_ranks([1.0] * 7, 2)


def test_work_model():
    model = WorkModel.from_transformer(64, causal=True)
    layout = SequenceLayout.build([10, 20], 2, causal=True)  # padded to 32
    assert model(layout) == 4 * 64 * 0.5 * (100 + 400) + 2 * (4 * 64**2 + 2 * 64 * 256) * 32


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory):
    return build_code_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("budget", [None, 32768], ids=["unpacked", "packed"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_dp_imbalance_on_the_code_corpus_is_below_10_percent(code_corpus, sampler, budget):
    """p=8, DP=8, 8 micro-batches per rank, documents cut at 32K (a 2M-token global batch when packed)."""
    lengths = Spans.build(DocumentDataset(code_corpus).lengths, 32768).length
    config = LoaderConfig(p=8, max_len=32768, token_budget=budget, sampler=sampler, micro_batches_per_step=8)
    sampler_ = MicroBatchSampler(lengths, config, dp_size=8)
    batches, position = [], StreamPosition(0, 0, 0)
    while position.epoch == 0:
        batches.append(sampler_.global_batch(position))
        position = batches[-1].next
    per_step = [batch.imbalance for batch in batches]
    over_epoch = sum(batch.loads.max() for batch in batches) / sum(batch.loads.mean() for batch in batches) - 1
    assert over_epoch < 0.10 and max(per_step) < 0.10, (over_epoch, max(per_step))


def test_code_corpus_is_the_stdlib(code_corpus):
    import sysconfig
    from pathlib import Path

    from megatron_paradyse.data.prepare import read_manifest

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    files = [p for p in files if p.stat().st_size]
    dataset = DocumentDataset(code_corpus)
    assert len(dataset) == len(files) and read_manifest(code_corpus)["tokenizer"] == "byte"
    for i in (0, len(files) // 2, len(files) - 1):
        np.testing.assert_array_equal(dataset[i], np.frombuffer(files[i].read_bytes(), dtype=np.uint8))
    counts = length_histogram(dataset.lengths)
    assert counts[0] == counts.max() and counts[-1] > 0  # long-tailed: most files short, some over 128K


def test_dna_corpus_matches_grch38_bins(tmp_path):
    prefix = build_dna_corpus(tmp_path, num_sequences=400, max_len=16384, seed=1)
    dataset = DocumentDataset(prefix)
    shares = length_histogram(dataset.lengths, scale=16384 / (624 * 1024)) / len(dataset)
    want = np.array(GRCH38_SHARES) / sum(GRCH38_SHARES)
    # rounding moves less than one sequence per bin; the longest, exactly max_len, adds one to the last
    np.testing.assert_allclose(shares, want, atol=2 / 400)
    assert dataset.lengths.max() == 16384 and dataset[0].max() < 64  # only A, C, G, T k-mers
    again = DocumentDataset(build_dna_corpus(tmp_path / "again", num_sequences=400, max_len=16384, seed=1))
    other = DocumentDataset(build_dna_corpus(tmp_path, num_sequences=400, max_len=16384, seed=2))
    assert np.array_equal(again[7], dataset[7]) and not np.array_equal(other.lengths, dataset.lengths)


def test_command_line(tmp_path, capsys):
    assert main(["build-corpus", "dna", "--out-dir", str(tmp_path), "--num-sequences", "50", "--max-len", "6400"]) == 0
    prefix = capsys.readouterr().out.split(":")[0]
    assert main(["stats", prefix, "--bin-scale", str(6400 / 638976)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{prefix}: tokenizer=dna3 source: synthetic DNA, seed 0")
    assert [line.split()[0] for line in out[2:9]] == [
        "0-4K",
        "4K-8K",
        "8K-16K",
        "16K-32K",
        "32K-64K",
        "64K-128K",
        "128K+",
    ]
    assert re.fullmatch(r"documents=50 tokens=\d+ min=\d+ median=[\d.]+ max=6400", out[9])
    assert main(["balance", prefix, "--p", "2", "--dp-size", "2", "--max-len", "6400", "--sampler", "curriculum"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[0] == "curriculum"
    assert main(["stats", str(tmp_path / "nothing")]) == 2
    assert f"error: no dataset at {tmp_path / 'nothing'}: neither" in capsys.readouterr().err
