"""Split-KV decode, paged caches and ragged batches on the GPU, every path against the float64
reference: contiguous caches with per-sequence lengths (0 and 1 included), block masks in decode
(shared and per head, shuffled, wide blocks), paged caches (page sizes 16 to 256 and an odd one,
NHD and HND, windows, softcap and ALiBi, long query chunks), bad page tables (raised before launch,
or clamped and flagged on the device), and varlen batches. Outputs are NaN-poisoned before each
call; every case prints its seed on failure.

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_decode_gpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, KVCacheError, reference, score_mods
from omnicupy.ops import decode

from decode_cases import compare, paged_from_contiguous, seed_of
from helpers import random_block_mask, random_qkv

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # benchmarks/ is not installed; `pytest` alone does not put the root on the path
    sys.path.insert(0, str(REPO))
from benchmarks import _systems  # noqa: E402

pytestmark = pytest.mark.gpu


def poisoned(shape, dtype):
    import cupy as cp

    return cp.full(shape, np.nan, dtype=dtype)


def device(*xs):
    import cupy as cp

    return tuple(cp.asarray(x) for x in xs)


# ------------------------------------------------------------------------------ contiguous caches
# (B, Hq, Hkv, Nq, Nkv, D, dtype, kv_lens, causal, num_splits, score_mod)
CONTIGUOUS = [
    pytest.param(4, 8, 2, 1, 777, 128, "fp16", [0, 1, 500, 777], True, None, None, id="gqa4-d128-nq1-ragged"),
    pytest.param(3, 8, 2, 1, 1000, 128, "bf16", [1000, 3, 999], True, 5, None, id="gqa4-d128-bf16-splits5"),
    pytest.param(2, 4, 4, 1, 1000, 64, "fp16", None, False, 7, None, id="mha-d64-full-splits7"),
    pytest.param(2, 4, 2, 5, 300, 64, "fp16", None, "bottom_right", None, None, id="bottom-right-no-lens"),
    pytest.param(2, 4, 2, 5, 300, 64, "bf16", None, True, 3, None, id="top-left-no-lens"),
    pytest.param(3, 16, 2, 4, 2049, 128, "fp16", [3, 100, 2049], True, None, None, id="gqa8-nq4-rows32"),
    pytest.param(2, 8, 2, 16, 1500, 128, "bf16", [1000, 1500], True, 3, None, id="gqa4-nq16-rows64"),
    pytest.param(2, 4, 1, 33, 600, 64, "fp16", [600, 40], True, None, None, id="mqa-nq33-three-m-tiles"),
    pytest.param(2, 4, 2, 2, 300, 32, "fp16", [300, 17], True, 2, None, id="d32"),
    pytest.param(2, 6, 3, 3, 400, 96, "bf16", [129, 400], False, None, None, id="d96-group2"),
    pytest.param(2, 4, 2, 1, 700, 256, "fp16", [700, 1], True, 4, None, id="d256-nq1"),
    pytest.param(1, 8, 2, 8, 300, 256, "bf16", [300], True, None, None, id="d256-rows32"),
    pytest.param(2, 8, 2, 2, 500, 128, "fp16", [500, 77], True, 3, score_mods.softcap(20.0), id="softcap"),
    pytest.param(2, 8, 2, 2, 500, 64, "bf16", [300, 500], True, None, score_mods.alibi(8), id="alibi"),
    pytest.param(2, 4, 2, 1, 64, 64, "fp16", [0, 0], True, 3, None, id="all-empty"),
    pytest.param(1, 4, 4, 8, 64, 64, "fp16", [5], True, None, None, id="fewer-keys-than-queries"),
    pytest.param(2, 8, 1, 1, 4096, 128, "fp16", [4096, 4000], False, 64, None, id="many-splits-gqa8"),
    # the merge's second 32-split chunk with its batches of 8 rows at D = 256, and empty splits in it
    pytest.param(3, 8, 2, 1, 2000, 256, "fp16", [2000, 70, 1999], True, 40, None, id="d256-splits40-empty-splits"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nkv,D,dtype,lens,causal,splits,score_mod", CONTIGUOUS)
def test_contiguous_decode(request, B, Hq, Hkv, Nq, Nkv, D, dtype, lens, causal, splits, score_mod):
    label = request.node.callspec.id
    seed = seed_of(label)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, B, Hq, Nq, D, dtype, Hkv=Hkv, Nkv=Nkv)
    kv_lens = None if lens is None else np.array(lens, np.int32)
    out = poisoned(q.shape, q.dtype)
    qd, kd, vd = device(q, k, v)
    got, lse = decode.decode_attention(qd, kd, vd, kv_lens=None if kv_lens is None else device(kv_lens)[0],
                                       num_splits=splits, causal=causal, score_mod=score_mod, return_lse=True, out=out)
    assert got is out
    ref_causal = causal
    if causal is True:
        ref_causal = "bottom_right" if lens is not None else "top_left"
    want, want_lse = reference.decode_attention(q, k, v, kv_lens, causal=ref_causal, score_mod=score_mod,
                                                return_lse=True)
    compare(got, lse, want, want_lse, dtype, label, seed)
    # host kv_lens and NumPy in/out take the same path
    if kv_lens is not None:
        again = decode.decode_attention(q, k, v, kv_lens=kv_lens, num_splits=splits, causal=causal, score_mod=score_mod)
        assert isinstance(again, np.ndarray)
        compare(again, None, want, want_lse, dtype, label + "/host", seed)


def test_decode_matches_the_forward_kernel():
    """The same call through both kernels (no kv_lens): both within tolerance of the reference."""
    seed = seed_of("decode-vs-forward")
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 8, 3, 128, "fp16", Hkv=2, Nkv=1000)
    qd, kd, vd = device(q, k, v)
    for causal in (False, True, "bottom_right"):
        a = decode.decode_attention(qd, kd, vd, causal=causal, num_splits=4)
        b = omnicupy.attention(qd, kd, vd, causal=causal)
        ref_causal = "top_left" if causal is True else causal
        want = reference.decode_attention(q, k, v, causal=ref_causal)
        for name, got in (("decode", a), ("forward", b)):
            err = reference.relative_error(got.get().astype(np.float64), want)
            assert err <= 3e-3, f"{name} causal={causal} (seed {seed}): {err:.2e}"


# ---------------------------------------------------------------------------- block masks in decode
# (B, Hq, Hkv, Nq, Nkv, D, dtype, Bm, Hm, q_block, kv_block, probs, shuffle, kv_lens, num_splits)
MASKED = [
    pytest.param(2, 8, 2, 3, 1000, 128, "fp16", 1, 1, 128, 128, (0.2, 0.3, 0.2, 0.3), False, None, None,
                 id="shared-mask"),
    pytest.param(2, 8, 2, 3, 700, 64, "bf16", 2, 8, 128, 64, (0.2, 0.2, 0.3, 0.3), False, [700, 300], 3,
                 id="per-head-mask-lens"),
    pytest.param(1, 4, 4, 16, 1200, 128, "fp16", 1, 4, 16, 256, (0.3, 0.2, 0.2, 0.3), True, None, 3,
                 id="shuffled-kv-block256"),
    pytest.param(3, 4, 1, 2, 500, 64, "fp16", 3, 1, 128, 32, (0.1, 0.3, 0.3, 0.3), False, [500, 0, 33], None,
                 id="per-batch-kv-block32"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nkv,D,dtype,Bm,Hm,qbs,kbs,probs,shuffle,lens,splits", MASKED)
def test_decode_block_masks(request, B, Hq, Hkv, Nq, Nkv, D, dtype, Bm, Hm, qbs, kbs, probs, shuffle, lens, splits):
    label = request.node.callspec.id
    seed = seed_of(label)
    rng = np.random.default_rng(seed)
    bm, dense = random_block_mask(rng, Bm, Hm, Nq, Nkv, qbs, kbs, probs=probs, shuffle=shuffle)
    q, k, v = random_qkv(rng, B, Hq, Nq, D, dtype, Hkv=Hkv, Nkv=Nkv)
    kv_lens = None if lens is None else np.array(lens, np.int32)
    out = poisoned(q.shape, q.dtype)
    got, lse = decode.decode_attention(*device(q, k, v), bm, kv_lens=kv_lens, num_splits=splits, return_lse=True,
                                       out=out)
    want, want_lse = reference.decode_attention(q, k, v, kv_lens, mask=dense, return_lse=True)
    compare(got, lse, want, want_lse, dtype, label, seed)


def test_decode_window_mask_from_mask_mod():
    """A bottom-right sliding window written as an opaque mask_mod (every block evaluated)."""
    seed = seed_of("window-mask-mod")
    rng = np.random.default_rng(seed)
    Nq, Nkv, W = 4, 900, 150

    def window(b, h, i, j):
        return (j <= i + Nkv - Nq) & (j > i + Nkv - Nq - W)

    bm = BlockMask.from_mask_mod(window, None, None, Nq, Nkv)
    q, k, v = random_qkv(rng, 2, 8, Nq, 128, "fp16", Hkv=2, Nkv=Nkv)
    got, lse = decode.decode_attention(*device(q, k, v), bm, return_lse=True, num_splits=5)
    want, want_lse = reference.decode_attention(q, k, v, mask=window, return_lse=True)
    compare(got, lse, want, want_lse, "fp16", "window-mask-mod", seed)


# --------------------------------------------------------------------------------------- paged
# (B, Hq, Hkv, Nq, D, dtype, page_size, layout, kv_lens, causal, window, score_mod, num_splits)
PAGED = [
    pytest.param(3, 8, 2, 1, 128, "fp16", 16, "NHD", [0, 1, 1000], True, None, None, None, id="ps16-nhd"),
    pytest.param(3, 8, 2, 1, 128, "fp16", 16, "HND", [0, 1, 1000], True, None, None, None, id="ps16-hnd"),
    pytest.param(2, 8, 2, 4, 128, "bf16", 32, "NHD", [513, 40], True, None, None, 4, id="ps32-nhd-nq4"),
    pytest.param(2, 4, 1, 16, 64, "fp16", 64, "HND", [1000, 17], True, None, None, None, id="ps64-hnd-nq16"),
    pytest.param(2, 8, 2, 2, 128, "fp16", 128, "NHD", [3000, 100], True, 300, None, None, id="ps128-window"),
    pytest.param(2, 8, 2, 3, 128, "bf16", 256, "HND", [1000, 600], False, 100, None, 2, id="ps256-window-noncausal"),
    pytest.param(2, 4, 2, 1, 64, "fp16", 24, "NHD", [100, 49], True, None, None, 3, id="ps24-odd"),
    pytest.param(2, 4, 1, 100, 64, "fp16", 16, "NHD", [400, 120], True, None, None, None, id="nq100-chunk"),
    pytest.param(1, 4, 2, 100, 64, "bf16", 16, "HND", [50], True, None, None, None, id="nq100-short-sequence"),
    pytest.param(2, 8, 2, 1, 128, "fp16", 64, "NHD", [700, 64], True, None, score_mods.softcap(10.0), None,
                 id="softcap-ps64"),
    pytest.param(2, 8, 2, 4, 64, "bf16", 16, "HND", [333, 700], True, 64, score_mods.alibi(8), None,
                 id="alibi-window-ps16"),
    pytest.param(2, 4, 2, 1, 256, "fp16", 32, "NHD", [300, 1], True, None, None, None, id="d256-ps32"),
    pytest.param(2, 4, 4, 2, 32, "fp16", 16, "HND", [100, 0], False, None, None, 2, id="d32-ps16"),
    pytest.param(1, 32, 8, 1, 128, "fp16", 16, "NHD", [4096], True, 1000, None, None, id="window-skips-pages"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,D,dtype,page_size,layout,lens,causal,window,score_mod,splits", PAGED)
def test_paged_attention(request, B, Hq, Hkv, Nq, D, dtype, page_size, layout, lens, causal, window, score_mod,
                         splits):
    import cupy as cp

    label = request.node.callspec.id
    seed = seed_of(label)
    rng = np.random.default_rng(seed)
    N = max(max(lens), 1)
    q, k, v = random_qkv(rng, B, Hq, Nq, D, dtype, Hkv=Hkv, Nkv=N)
    kv_lens = np.array(lens, np.int32)
    kp, vp, table = paged_from_contiguous(rng, k, v, page_size, layout, kv_lens)
    want, want_lse = reference.paged_attention(q, kp, vp, table, kv_lens, causal=causal, window=window,
                                               score_mod=score_mod, return_lse=True, layout=layout)
    # Device metadata, checked on the device before launch, into a poisoned out
    out = poisoned(q.shape, q.dtype)
    got, lse = omnicupy.paged_attention(*device(q, kp, vp, table, kv_lens), causal=causal, window=window,
                                        score_mod=score_mod, return_lse=True, out=out, layout=layout,
                                        num_splits=splits)
    assert got is out
    compare(got, lse, want, want_lse, dtype, label, seed)
    # Host metadata (checked on the host), NumPy out
    host_out = np.full(q.shape, np.nan, dtype=q.dtype)
    got = omnicupy.paged_attention(cp.asarray(q), cp.asarray(kp), cp.asarray(vp), table, kv_lens, causal=causal,
                                   window=window, score_mod=score_mod, out=host_out, layout=layout, validate=False)
    assert got is host_out
    compare(got, None, want, want_lse, dtype, label + "/host-metadata", seed)
    assert decode.take_device_errors() == 0


def test_paged_equals_contiguous_cache():
    """One cache, three layouts (contiguous, pages of 16, pages of 64): the same answer."""
    seed = seed_of("paged-vs-contiguous")
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 32, 1, 128, "fp16", Hkv=8, Nkv=2000)
    lens = np.array([2000, 1234], np.int32)
    contiguous = decode.decode_attention(*device(q, k, v), kv_lens=lens, causal=True).get().astype(np.float64)
    for page_size in (16, 64):
        kp, vp, table = paged_from_contiguous(rng, k, v, page_size, "NHD", lens)
        paged = omnicupy.paged_attention(*device(q, kp, vp, table, lens)).get().astype(np.float64)
        err = reference.relative_error(paged, contiguous)
        assert err < 1e-3, f"page size {page_size} (seed {seed}): {err:.2e} from the contiguous cache"


def test_bad_page_table_on_the_device():
    """validate=True raises before launch; validate=False never reads outside the pool, flags it,
    and leaves the other sequences right."""
    import cupy as cp

    seed = seed_of("bad-pages")
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, 8, 1, 64, "fp16", Hkv=2, Nkv=300)
    lens = np.array([300, 200], np.int32)
    kp, vp, table = paged_from_contiguous(rng, k, v, 16, "NHD", lens)
    bad = table.copy()
    bad[1, 3] = kp.shape[0] + 1000  # sequence 1 uses page 3 (keys 48..63)
    qd, kd, vd, bad_d, lens_d = device(q, kp, vp, bad, lens)
    with pytest.raises(KVCacheError, match=r"page_table\[1, 3\]"):
        omnicupy.paged_attention(qd, kd, vd, bad_d, lens_d)
    decode.take_device_errors(raise_error=False)
    out = omnicupy.paged_attention(qd, kd, vd, bad_d, lens_d, validate=False)
    cp.cuda.runtime.deviceSynchronize()
    with pytest.raises(KVCacheError, match="page ids outside"):
        decode.take_device_errors()
    assert decode.take_device_errors() == 0  # read and cleared
    want = reference.paged_attention(q[:1], kp, vp, table[:1], lens[:1])
    compare(out[:1], None, want, np.zeros(want.shape[:3]), "fp16", "bad-pages/good-sequence", seed)
    assert np.all(np.isfinite(out.get().astype(np.float64)))
    # A length beyond the table: clamped and flagged
    too_long = cp.asarray(np.array([300, 10**6], np.int32))
    omnicupy.paged_attention(qd, kd, vd, cp.asarray(table), too_long, validate=False)
    assert decode.take_device_errors(raise_error=False) & decode.ERROR_KV_LEN


# -------------------------------------------------------------------------------------- varlen
# (q lengths, k lengths or None for the same, Hq, Hkv, D, dtype, causal)
VARLEN = [
    pytest.param([1, 100, 0, 257, 1000], None, 4, 2, 64, "fp16", True, id="self-causal-with-empty"),
    pytest.param([300, 5, 700], None, 4, 4, 128, "bf16", False, id="self-full"),
    pytest.param([3, 10, 200], [8, 100, 150], 4, 2, 64, "fp16", True, id="cross-causal"),
    pytest.param([1, 1, 1], [1000, 10, 0], 8, 2, 128, "fp16", True, id="decode-like"),
]


@pytest.mark.parametrize("q_lens,k_lens,Hq,Hkv,D,dtype,causal", VARLEN)
def test_varlen_attention(request, q_lens, k_lens, Hq, Hkv, D, dtype, causal):
    import cupy as cp

    label = request.node.callspec.id
    seed = seed_of(label)
    rng = np.random.default_rng(seed)
    k_lens = q_lens if k_lens is None else k_lens
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q4, k4, v4 = random_qkv(rng, 1, Hq, int(cu_q[-1]), D, dtype, Hkv=Hkv, Nkv=int(cu_k[-1]))
    q, k, v = (np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q4, k4, v4))
    out = poisoned(q.shape, q.dtype)
    got, lse = omnicupy.varlen_attention(*device(q, k, v), cp.asarray(cu_q), cp.asarray(cu_k), causal=causal,
                                         return_lse=True, out=out)
    assert got is out
    want, want_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    # rows as [Hq, total_q, D] so that the LSE [Hq, total_q] lines up with them
    compare(got.transpose(1, 0, 2), lse, want.transpose(1, 0, 2), want_lse, dtype, label, seed)


# ------------------------------------------------------------------- prefill at the bench's size
# bench_decode.py --parts prefill died with cudaErrorIllegalAddress (issue 16), and at 32 query heads
# the padded batch (q of exactly 2**31 bytes) met an illegal address in attention(). These run the
# same calls at the same sizes, into NaN-poisoned outputs, and check the rows at the highest
# addresses (the end of the longest sequence, the last batch and head), where a 32-bit offset
# would go wrong. lab/tools/dec_prefill.py runs them step by step.
PREFILL_LENGTHS = (1024, 2048, 3072, 4096, 8192, 12288, 16384, 32768)


def _device_randn(cp, shape, seed):
    """fp16 unit normals drawn on the device (the decode benchmark's chunked draw: no float32 copy
    of a multi-GB array)."""
    return _systems.device_normal(cp, shape, np.float16, cp.random.default_rng(seed))


@pytest.mark.parametrize("lengths,Hq,Hkv,family", [
    pytest.param(PREFILL_LENGTHS, 16, 4, "auto", id="bench-1k-32k"),
    pytest.param(PREFILL_LENGTHS, 16, 4, "wgmma", id="bench-1k-32k-wgmma"),
    pytest.param((1000, 2049, 3071, 4097, 8191, 12289, 16383, 32769), 16, 4, "auto", id="odd-ends"),
])
def test_varlen_prefill_at_bench_size(request, monkeypatch, lengths, Hq, Hkv, family):
    import cupy as cp

    from decode_cases import causal_rows

    label = request.node.callspec.id
    seed = seed_of(label)
    monkeypatch.setenv("OMNICUPY_MMA", family)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, group = int(cu[-1]), Hq // Hkv
    q, k, v = (_device_randn(cp, (total, h, 128), seed + i) for i, h in enumerate((Hq, Hkv, Hkv)))
    out = poisoned(q.shape, q.dtype)
    for call in ("first", "steady"):  # the general path, then recall's
        out.fill(np.nan)
        got = omnicupy.varlen_attention(q, k, v, cu, cu, causal=True, out=out)
        cp.cuda.runtime.deviceSynchronize()
        assert bool(cp.isfinite(got).all()), f"{label}/{call} (seed {seed}): NaN rows left unwritten"
        for s in (0, 3, len(lengths) - 1):
            a, b = int(cu[s]), int(cu[s + 1])
            first = max(a, b - 128)
            for h in (0, Hq - 1):
                want = causal_rows(q[first:b, h], k[a:b, h // group], v[a:b, h // group], first - a)
                err = reference.relative_error(got[first:b, h].get().astype(np.float64), want)
                assert err <= 3e-3, f"{label}/{call} sequence {s} head {h} (seed {seed}): {err:.2e}"


@pytest.mark.parametrize("B,Hq,Hkv,N", [
    pytest.param(8, 16, 4, 32768, id="padded-1GiB"),
    pytest.param(8, 32, 8, 32768, id="padded-2GiB"),  # q and out of exactly 2**31 bytes
])
def test_padded_prefill_past_2gib(request, B, Hq, Hkv, N):
    import cupy as cp

    from decode_cases import causal_rows

    label = request.node.callspec.id
    seed = seed_of(label)
    q = _device_randn(cp, (B, Hq, N, 128), seed)
    k = _device_randn(cp, (B, Hkv, N, 128), seed + 1)
    v = _device_randn(cp, (B, Hkv, N, 128), seed + 2)
    out = poisoned(q.shape, q.dtype)
    got = omnicupy.attention(q, k, v, causal=True, out=out)
    cp.cuda.runtime.deviceSynchronize()
    assert bool(cp.isfinite(got).all()), f"{label} (seed {seed}): NaN rows left unwritten"
    for b, h in ((0, 0), (B - 1, Hq - 1)):
        for first in (0, N - 64):
            hk = h // (Hq // Hkv)
            want = causal_rows(q[b, h, first:first + 64], k[b, hk, :first + 64], v[b, hk, :first + 64], first)
            err = reference.relative_error(got[b, h, first:first + 64].get().astype(np.float64), want)
            assert err <= 3e-3, f"{label} batch {b} head {h} rows {first}.. (seed {seed}): {err:.2e}"


# ------------------------------------------------------------------------------- fused combine
# (B, Hq, Hkv, Nq, Nkv, D, dtype, kv_lens, causal, num_splits)
FUSED = [
    pytest.param(4, 8, 2, 1, 777, 128, "fp16", [0, 1, 500, 777], True, 5, id="ragged-with-empty"),
    pytest.param(2, 8, 1, 1, 4096, 128, "bf16", [4096, 4000], False, 64, id="64-splits-gqa8"),
    pytest.param(2, 8, 2, 16, 1500, 128, "fp16", [1000, 1500], True, 3, id="rows64-two-row-warps"),
    pytest.param(2, 4, 1, 33, 600, 64, "fp16", [600, 40], True, 4, id="three-m-tiles"),
    pytest.param(2, 4, 2, 1, 700, 256, "fp16", [700, 1], True, 7, id="d256"),
    pytest.param(2, 32, 8, 1, 8192, 128, "fp16", None, True, None, id="heuristic-splits"),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nkv,D,dtype,lens,causal,splits", FUSED)
def test_fused_combine(request, monkeypatch, B, Hq, Hkv, Nq, Nkv, D, dtype, lens, causal, splits):
    """The last CTA of each unit merges the splits (no combine launch): the same answer, and the
    counters are back to zero after every call (three calls in a row, the last one replayed from a
    CUDA graph)."""
    import cupy as cp

    label = request.node.callspec.id
    seed = seed_of(label)
    monkeypatch.setattr(decode, "FUSED_COMBINE", True)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, B, Hq, Nq, D, dtype, Hkv=Hkv, Nkv=Nkv)
    kv_lens = None if lens is None else np.array(lens, np.int32)
    qd, kd, vd = device(q, k, v)
    lens_d = None if kv_lens is None else cp.asarray(kv_lens)
    mode = "bottom_right" if causal and lens is None else causal
    want, want_lse = reference.decode_attention(q, k, v, kv_lens, causal="bottom_right" if causal else False,
                                                return_lse=True)
    for call in range(3):
        out = poisoned(q.shape, q.dtype)
        got, lse = decode.decode_attention(qd, kd, vd, kv_lens=lens_d, num_splits=splits, causal=mode,
                                           return_lse=True, out=out)
        compare(got, lse, want, want_lse, dtype, f"{label}/call{call}", seed)
    plan = decode.decode_plan(decode.check_qkv(qd, kd, vd), None, lens_d, splits, causal=mode)
    assert plan.fused == (plan.num_splits > 1) and plan.combine is None, f"{label}: {plan}"
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = poisoned(q.shape, q.dtype)
        stream.begin_capture()
        decode.decode_attention(qd, kd, vd, kv_lens=lens_d, num_splits=splits, causal=mode, out=out)
        graph = stream.end_capture()
        for _ in range(2):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            compare(out, None, want, want_lse, dtype, f"{label}/graph", seed)


# ------------------------------------------------------------------------------- steady state
STEADY = [
    pytest.param("decode_attention", id="decode-attention"),
    pytest.param("attention-kv-lens", id="attention-kv-lens"),
    pytest.param("attention-auto", id="attention-few-rows"),
    pytest.param("paged", id="paged-validated"),
    pytest.param("paged-unchecked", id="paged-validate-false"),
]


@pytest.mark.parametrize("entry", STEADY)
@pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused"])
def test_steady_state_decode_calls(request, monkeypatch, entry, fused):
    """The second and later calls of a signature replay the first call's launches (ops/recall.py,
    ChainRecipe) on new arrays (new pointers, new kv_lens values): each one against float64."""
    label = request.node.callspec.id
    seed = seed_of(label)
    monkeypatch.setattr(decode, "FUSED_COMBINE", fused)
    B, Hq, Hkv, Nq, N, D = 3, 8, 2, 2, 700, 128
    for call in range(3):
        rng = np.random.default_rng(seed + call)
        q, k, v = random_qkv(rng, B, Hq, Nq, D, "fp16", Hkv=Hkv, Nkv=N)
        lens = rng.integers(0, N + 1, size=B).astype(np.int32)
        lens[0] = N
        qd, kd, vd, lens_d = device(q, k, v, lens)
        if entry.startswith("paged"):
            pages = sum(-(-int(n) // 16) for n in lens)  # one pool size for every call: one signature
            kp, vp, table = paged_from_contiguous(rng, k, v, 16, "NHD", lens, spare_pages=B * -(-N // 16) + 3 - pages)
            got, lse = omnicupy.paged_attention(*device(q, kp, vp, table), lens_d, return_lse=True, num_splits=4,
                                                validate=entry == "paged")
            want, want_lse = reference.paged_attention(q, kp, vp, table, lens, return_lse=True)
        elif entry == "attention-auto":  # no kv_lens: the whole cache, bottom-right
            got, lse = omnicupy.attention(qd, kd, vd, causal="bottom_right", return_lse=True)
            want, want_lse = reference.decode_attention(q, k, v, None, causal="bottom_right", return_lse=True)
        else:
            fn = decode.decode_attention if entry == "decode_attention" else omnicupy.attention
            got, lse = fn(qd, kd, vd, kv_lens=lens_d, causal=True, num_splits=3, return_lse=True)
            want, want_lse = reference.decode_attention(q, k, v, lens, causal="bottom_right", return_lse=True)
        compare(got, lse, want, want_lse, "fp16", f"{label}/call{call}", seed + call)
    assert decode.take_device_errors() == 0
