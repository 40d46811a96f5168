"""omnicupy.masks: each mask's rule against an independent dense definition, names, structure, errors."""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import masks
from omnicupy.errors import MaskError
from omnicupy.reference import dense_mask_from_mod

from mask_cases import MASK_CASES

N_MAX = 300
DOC_LENGTHS = [5, 60, 1, 100, 34, 100]  # sums to 300
DOC_IDS = masks.doc_ids_from_lengths(DOC_LENGTHS)
SEGMENTS = [("text", 40), ("image", 57), ("image", 3), ("text", 100), ("image", 100)]  # 300 positions
SIZES = [(1, 1), (77, N_MAX), (N_MAX, 77), (N_MAX, N_MAX)]


# ---------------------------------------------------------------- independent dense definitions
def tri(nq, nk, k=0):
    """allowed[i, j] = j <= i + k."""
    return np.tri(nq, nk, k, dtype=bool)


def spans(lengths):
    ends = np.cumsum(lengths)
    return list(zip(ends - lengths, ends))


def ref_dilated(window, dilation):
    def dense(nq, nk):
        out = np.zeros((nq, nk), dtype=bool)
        for i in range(nq):
            for s in range(window):
                if 0 <= i - s * dilation < nk:
                    out[i, i - s * dilation] = True
        return out
    return dense


def ref_blocks(lengths, causal):
    def dense(nq, nk):
        out = np.zeros((N_MAX, N_MAX), dtype=bool)
        for s, e in spans(lengths):
            out[s:e, s:e] = True
        out = out[:nq, :nk]
        return out & tri(nq, nk) if causal else out
    return dense


def ref_interleaved(segments):
    def dense(nq, nk):
        out = np.zeros((N_MAX, N_MAX), dtype=bool)
        for (kind, _), (s, e) in zip(segments, spans(np.array([n for _, n in segments]))):
            for i in range(s, e):
                out[i, : (e if kind == "image" else i + 1)] = True
        return out[:nq, :nk]
    return dense


FORMULAS = [
    pytest.param(masks.causal(), tri, id="causal"),
    pytest.param(masks.sliding_window(50), lambda nq, nk: tri(nq, nk) & ~tri(nq, nk, -50), id="sliding_window_50"),
    pytest.param(masks.sliding_window(1), lambda nq, nk: tri(nq, nk) & ~tri(nq, nk, -1), id="sliding_window_1"),
    pytest.param(masks.local_window(37, 11), lambda nq, nk: tri(nq, nk, 11) & ~tri(nq, nk, -38), id="local_window_37_11"),
    pytest.param(masks.prefix_lm(100), lambda nq, nk: tri(nq, nk) | (np.arange(nk) < 100), id="prefix_lm_100"),
    pytest.param(masks.prefix_lm(0), tri, id="prefix_lm_0"),
    pytest.param(masks.dilated_sliding_window(8, 3), ref_dilated(8, 3), id="dilated_8_3"),
    pytest.param(masks.dilated_sliding_window(5, 1), ref_dilated(5, 1), id="dilated_5_1"),
    pytest.param(masks.document(DOC_IDS), ref_blocks(DOC_LENGTHS, True), id="document_causal"),
    pytest.param(masks.document(DOC_IDS, causal=False), ref_blocks(DOC_LENGTHS, False), id="document_noncausal"),
    pytest.param(masks.block_diagonal(DOC_LENGTHS), ref_blocks(DOC_LENGTHS, False), id="block_diagonal"),
    pytest.param(masks.interleaved(SEGMENTS), ref_interleaved(SEGMENTS), id="interleaved"),
    pytest.param(masks.and_masks(masks.sliding_window(50), masks.document(DOC_IDS)),
                 lambda nq, nk: tri(nq, nk) & ~tri(nq, nk, -50) & ref_blocks(DOC_LENGTHS, True)(nq, nk),
                 id="and_masks"),
    pytest.param(masks.or_masks(masks.prefix_lm(30), masks.local_window(5, 5)),
                 lambda nq, nk: tri(nq, nk) | (np.arange(nk) < 30) | (tri(nq, nk, 5) & ~tri(nq, nk, -6)),
                 id="or_masks"),
    pytest.param(masks.not_mask(masks.causal()), lambda nq, nk: ~tri(nq, nk), id="not_mask"),
]


@pytest.mark.parametrize("nq, nk", SIZES, ids=lambda s: str(s))
@pytest.mark.parametrize("mod, expected", FORMULAS)
def test_rule_matches_independent_definition(mod, expected, nq, nk):
    got = dense_mask_from_mod(mod, 1, 1, nq, nk)[0, 0]
    np.testing.assert_array_equal(got, expected(nq, nk))


@pytest.mark.parametrize("case_id, factory", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_reference_call_form(case_id, factory):
    """omnicupy.reference calls mask_mods with int b, h and 2-D q/kv index arrays."""
    mod = factory(77, 120)
    qi, ki = np.arange(77)[:, None], np.arange(120)[None, :]
    got = np.broadcast_to(np.asarray(mod(0, 0, qi, ki), dtype=bool), (77, 120))
    np.testing.assert_array_equal(got, dense_mask_from_mod(mod, 1, 1, 77, 120)[0, 0])


STRUCTURED = [pytest.param(f, id=i) for i, f in MASK_CASES if f(N_MAX, N_MAX).bounds is not None]


@pytest.mark.parametrize("factory", STRUCTURED)
def test_row_bounds_describe_the_rule(factory):
    """Exact bounds equal the rule; inexact ones contain it (the claims the structured path relies on)."""
    mod = factory(N_MAX, N_MAX)
    q = np.arange(N_MAX).reshape(1, 1, -1)
    start, end = (np.broadcast_to(a, q.shape)[0, 0] for a in mod.bounds(np.zeros((1, 1, 1), int), np.zeros((1, 1, 1), int), q))
    kv = np.arange(N_MAX)
    inside = (kv[None, :] >= start[:, None]) & (kv[None, :] < end[:, None])
    rule = dense_mask_from_mod(mod, 1, 1, N_MAX, N_MAX)[0, 0]
    if mod.bounds_exact:
        np.testing.assert_array_equal(rule, inside)
    else:
        assert not np.any(rule & ~inside)


@pytest.mark.parametrize("mod, name", [
    pytest.param(masks.causal(), "causal", id="causal"),
    pytest.param(masks.sliding_window(1024), "sliding_window_1024", id="sliding_window"),
    pytest.param(masks.local_window(64, 32), "local_window_64_32", id="local_window"),
    pytest.param(masks.prefix_lm(2048), "prefix_lm_2048", id="prefix_lm"),
    pytest.param(masks.dilated_sliding_window(256, 4), "dilated_sliding_window_256_dilation_4", id="dilated"),
    pytest.param(masks.document(DOC_IDS), "document_6docs", id="document"),
    pytest.param(masks.document(DOC_IDS, causal=False), "document_noncausal_6docs", id="document_noncausal"),
    pytest.param(masks.block_diagonal([3, 4]), "block_diagonal_2blocks", id="block_diagonal"),
    pytest.param(masks.interleaved(SEGMENTS), "interleaved_2text_3image", id="interleaved"),
    pytest.param(masks.and_masks(masks.causal(), masks.sliding_window(8)), "and_masks(causal, sliding_window_8)", id="and"),
    pytest.param(masks.or_masks(masks.causal(), masks.prefix_lm(8)), "or_masks(causal, prefix_lm_8)", id="or"),
    pytest.param(masks.not_mask(masks.causal()), "not_mask(causal)", id="not"),
])
def test_name_carries_parameters(mod, name):
    assert mod.name == name and mod.__name__ == name and repr(mod) == f"MaskMod({name})"
    assert mod.__doc__


@pytest.mark.parametrize("mod, expr", [
    pytest.param(masks.causal(), "q_idx >= kv_idx", id="causal"),
    pytest.param(masks.sliding_window(1024), "q_idx >= kv_idx && q_idx - kv_idx < 1024", id="sliding_window"),
    pytest.param(masks.document(DOC_IDS), None, id="document"),
    pytest.param(masks.and_masks(masks.causal()), None, id="and"),
])
def test_cuda_expr(mod, expr):
    assert mod.cuda_expr == expr


def test_combinators_accept_plain_functions():
    def upper_half(b, h, q_idx, kv_idx):
        return kv_idx >= 150

    mod = masks.and_masks(masks.causal(), upper_half)
    assert mod.bounds is None and mod.name == "and_masks(causal, upper_half)"
    np.testing.assert_array_equal(dense_mask_from_mod(mod, 1, 1, N_MAX, N_MAX)[0, 0],
                                  tri(N_MAX, N_MAX) & (np.arange(N_MAX) >= 150))


def test_combinators_keep_the_tightest_extent():
    short, long = masks.document(DOC_IDS[:100]), masks.block_diagonal([200])
    assert masks.and_masks(short, long).length == 100
    assert masks.or_masks(masks.causal(), long).length == 200
    assert masks.not_mask(masks.causal()).length is None


def test_document_without_contiguous_runs_has_no_structure():
    ids = np.array([0, 0, 1, 1, 0, 0, 2])
    mod = masks.document(ids, causal=False)
    assert mod.bounds is None
    np.testing.assert_array_equal(dense_mask_from_mod(mod, 1, 1, 7, 7)[0, 0], ids[:, None] == ids[None, :])


def test_per_batch_document_ids():
    ids = np.stack([masks.doc_ids_from_lengths([3, 5]), masks.doc_ids_from_lengths([6, 2])])
    mod = masks.document(ids)
    assert mod.batch == 2 and mod.length == 8
    dense = dense_mask_from_mod(mod, 2, 1, 8, 8)
    for b in range(2):
        np.testing.assert_array_equal(dense[b, 0], (ids[b][:, None] == ids[b][None, :]) & tri(8, 8))


def test_doc_ids_from_lengths():
    np.testing.assert_array_equal(masks.doc_ids_from_lengths([2, 1, 3]), [0, 0, 1, 2, 2, 2])


def test_dense_mask_mod_broadcasts_size_one_dims():
    mask = np.random.default_rng(0).random((1, 2, 5, 7)) < 0.5
    mod = masks.dense(mask)
    assert mod.batch is None
    np.testing.assert_array_equal(dense_mask_from_mod(mod, 3, 2, 5, 7), np.broadcast_to(mask, (3, 2, 5, 7)))


def _raise_extent(mod, B, q_len, kv_len):
    mod.check_extent(B, q_len, kv_len)


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: masks.sliding_window(0), "window must be >= 1", id="sliding_window-zero"),
    pytest.param(lambda: masks.sliding_window(2.5), "window must be an int", id="sliding_window-float"),
    pytest.param(lambda: masks.local_window(-1, 0), "left must be >= 0", id="local_window-negative"),
    pytest.param(lambda: masks.prefix_lm(True), "prefix_len must be an int", id="prefix_lm-bool"),
    pytest.param(lambda: masks.dilated_sliding_window(4, 0), "dilation must be >= 1", id="dilated-zero"),
    pytest.param(lambda: masks.document(np.zeros(4)), "doc_ids must be an integer array", id="document-float"),
    pytest.param(lambda: masks.document(np.zeros((1, 1, 4), int)), r"doc_ids must be .*\[N\] or \[B, N\]", id="document-3d"),
    pytest.param(lambda: masks.document(np.zeros(0, int)), "non-empty", id="document-empty"),
    pytest.param(lambda: masks.block_diagonal([3, 0]), r"lengths\[i\] must be >= 1", id="block_diagonal-zero"),
    pytest.param(lambda: masks.block_diagonal([]), "lengths must not be empty", id="block_diagonal-empty"),
    pytest.param(lambda: masks.interleaved([("audio", 3)]), r"segments\[0\] must be \('text', n\)", id="interleaved-kind"),
    pytest.param(lambda: masks.interleaved([("text", 0)]), "length must be >= 1", id="interleaved-zero"),
    pytest.param(lambda: masks.interleaved([]), "segments must not be empty", id="interleaved-empty"),
    pytest.param(lambda: masks.and_masks(), "needs at least one mask_mod", id="and-empty"),
    pytest.param(lambda: masks.or_masks(masks.causal(), 3), "argument 1 is not callable", id="or-not-callable"),
    pytest.param(lambda: masks.and_masks(masks.document(np.zeros((2, 4), int)), masks.document(np.zeros((3, 4), int))),
                 "different batch sizes", id="and-batch-mismatch"),
    pytest.param(lambda: masks.dense(np.ones((4, 4), bool)), "mask must be 4-D", id="dense-2d"),
    pytest.param(lambda: masks.dense(np.ones((1, 1, 4, 4), np.int8)), "mask must be a boolean array", id="dense-int"),
    pytest.param(lambda: masks.dense(np.ones((1, 1, 0, 4), bool)), "zero-size dimension", id="dense-empty"),
    pytest.param(lambda: _raise_extent(masks.document(DOC_IDS), None, 301, 10), "defined for 300 positions", id="extent-length"),
    pytest.param(lambda: _raise_extent(masks.document(np.zeros((2, 4), int)), None, 4, 4), "pass B=2", id="extent-batch"),
])
def test_errors(make, match):
    with pytest.raises(MaskError, match=match):
        make()
