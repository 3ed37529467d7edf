"""The canonical layout: padding, zigzag order, its inverse, and attention visibility."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_paradyse.core.layout import Segment, SequenceLayout, padded_length, zigzag_permutation


@pytest.mark.parametrize(("seq_len", "p", "expected"), [(1, 1, 2), (13, 2, 16), (16, 2, 16), (25, 3, 30), (29, 4, 32)])
def test_padded_length_is_the_next_multiple_of_2p(seq_len, p, expected):
    assert padded_length(seq_len, p) == expected


def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    # 16 tokens, p=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert zigzag_permutation(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    layout = SequenceLayout.build(13, 2, causal=True)
    assert layout.natural_positions[layout.local_slice(1)].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_bidirectional_order_is_contiguous():
    layout = SequenceLayout.build(10, 3, causal=False)
    assert layout.padded_len == 12 and layout.is_identity
    assert layout.natural_positions.tolist() == list(range(12))


@pytest.mark.parametrize(("n", "p"), [(1, 1), (7, 2), (100, 3), (4097, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_local_runs_are_the_maximal_runs_of_each_ranks_natural_positions(n, p, causal):
    layout = SequenceLayout.build(n, p, causal=causal)
    for rank in range(p):
        positions = layout.natural_positions[layout.local_slice(rank)].tolist()
        runs = layout.local_runs(rank)
        assert [x for r in runs for x in range(r.natural, r.natural + r.length)] == positions
        assert [r.local for r in runs] == [sum(r.length for r in runs[:i]) for i in range(len(runs))]
        assert all(a.natural + a.length != b.natural for a, b in zip(runs, runs[1:]))  # maximal


@pytest.mark.parametrize(("docs", "p", "causal"), [((13,), 2, True), ((5, 7, 3), 3, True), ((9, 2), 4, False)])
def test_to_canonical_and_back_round_trip_ids_labels_masks_positions(docs, p, causal):
    layout = SequenceLayout.build(docs, p, causal=causal)
    ids = torch.randint(0, 1000, (layout.valid_len, 3))
    canonical = layout.to_canonical(ids, pad_value=-1)
    assert canonical.shape == (layout.padded_len, 3)
    assert torch.equal(layout.from_canonical(canonical), ids)
    # Padding lands exactly where the loss mask is zero.
    assert torch.equal((canonical[:, 0] == -1).float(), 1 - layout.loss_mask)
    # Labels permuted on dim 1 of a [b, s] tensor come back the same way.
    labels = torch.arange(layout.valid_len).repeat(2, 1)
    assert torch.equal(layout.from_canonical(layout.to_canonical(labels, dim=1), dim=1), labels)


def test_position_ids_restart_in_every_document_and_follow_the_permutation():
    layout = SequenceLayout.build((5, 7), 2, causal=True)  # 12 tokens, padded to 12
    natural = layout.from_canonical(layout.position_ids)
    assert natural.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]


def _dense_visibility(layout: SequenceLayout, q_pos, k_pos) -> torch.Tensor:
    doc = torch.zeros(layout.padded_len, dtype=torch.long)
    for i, (start, end) in enumerate(layout.doc_bounds):
        doc[start:end] = i
    q_pos, k_pos = torch.as_tensor(q_pos), torch.as_tensor(k_pos)
    visible = doc[q_pos][:, None] == doc[k_pos][None, :]
    if layout.causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    return visible


def _segment_cover(segments, sq, sk) -> torch.Tensor:
    cover = torch.zeros(sq, sk, dtype=torch.int64)
    for seg in segments:
        block = torch.ones(seg.q_end - seg.q_start, seg.k_end - seg.k_start, dtype=torch.int64)
        if seg.causal:
            assert seg.q_end - seg.q_start == seg.k_end - seg.k_start, "causal segments must be square"
            block = block.tril()
        cover[seg.q_start : seg.q_end, seg.k_start : seg.k_end] += block
    return cover


LAYOUTS = [
    SequenceLayout.build(docs, p, causal=causal)
    for docs, p, causal in itertools.product([(13,), (16,), (3, 9, 4), (1, 1, 1, 20)], [1, 2, 3, 4], [True, False])
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.doc_lengths}-p{lay.p}-{lay.order}")
def test_segments_cover_exactly_the_visible_pairs_once(layout):
    """Against a dense mask built from documents and positions: every visible (query, key) pair is
    covered by exactly one segment, and no invisible pair by any."""
    natural = torch.arange(layout.padded_len)
    assert torch.equal(
        _segment_cover(layout.full_segments(), layout.padded_len, layout.padded_len),
        _dense_visibility(layout, natural, natural).long(),
    )
    for q_rank, k_rank in itertools.product(range(layout.p), repeat=2):
        q_pos = layout.natural_positions[layout.local_slice(q_rank)]
        k_pos = layout.natural_positions[layout.local_slice(k_rank)]
        cover = _segment_cover(layout.ring_segments(q_rank, k_rank), layout.local_len, layout.local_len)
        assert torch.equal(cover, _dense_visibility(layout, q_pos, k_pos).long()), (q_rank, k_rank)


def test_zigzag_balances_causal_work_across_ranks():
    layout = SequenceLayout.build(64, 4, causal=True)
    work = [
        sum(
            (s.q_end - s.q_start) * (s.k_end - s.k_start) / (2 if s.causal else 1)
            for k in range(4)
            for s in layout.ring_segments(r, k)
        )
        for r in range(4)
    ]
    assert max(work) == min(work), work  # contiguous order would give 136 : 392 : 648 : 904


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"sequence length 13 is not a multiple of 2p=4; pad it to .*=16"):
        SequenceLayout((13,), 2, True, 13)
    with pytest.raises(ValueError, match=r"doc_lengths must be positive, got \(3, 0\)"):
        SequenceLayout.build((3, 0), 2, causal=True)
    layout = SequenceLayout.build(13, 2, causal=True)
    with pytest.raises(ValueError, match=r"expected 13 \(unpadded\) or 16 \(padded\) entries on dim 0, got 12"):
        layout.to_canonical(torch.zeros(12))
    with pytest.raises(ValueError, match=r"x_local has 6 tokens on dim 0, but the layout puts 8 on each of p=2 ranks"):
        layout.check_local(torch.zeros(6, 1, 4))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        layout.local_slice(2)


def test_causal_attention_in_contiguous_order_is_stock_megatrons_split():
    """Stock Megatron feeds tokens in natural order, split contiguously: the layout of the drop-in spec."""
    layout = SequenceLayout.build((5, 11), 2, causal=True, order="contiguous")
    assert (layout.order, SequenceLayout.build(16, 2, causal=True).order) == ("contiguous", "zigzag")
    assert layout.is_identity and torch.equal(layout.natural_positions, torch.arange(16))
    assert [tuple(r) for r in layout.local_runs(1)] == [(0, 8, 8)]
    # rank 1 holds positions 8..15: its queries see all of rank 0's keys of their own document (5..7)
    assert layout.ring_segments(1, 0) == (Segment(0, 8, 5, 8, False),)
    assert layout.ring_segments(0, 1) == ()
    assert layout.ring_segments(0, 0) == (Segment(0, 5, 0, 5, True), Segment(5, 8, 5, 8, True))
    with pytest.raises(ValueError, match=r"order must be one of zigzag, contiguous \(or None\), got 'natural'"):
        SequenceLayout.build(16, 2, causal=True, order="natural")
