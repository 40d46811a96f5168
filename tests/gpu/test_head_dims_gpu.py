"""Padded head dims on the GPU: head dims that are not a tile's (8, 40, 80, 136, 160, 192, 248) run
on the next tile with zero-filled padding columns. Each case against the float64 reference, on
every forward family the device has (mma.sync; wgmma and tma on sm_90, where their tile pads no
more than mma.sync's), with full, causal and document (PARTIAL blocks) masks, odd lengths, both
dtypes; the backward's three gradients; the decode, paged and varlen paths.

Every input comes from a logged seed (helpers.seeded_rng: printed, named in each failure, replayed
with OMNICUPY_TEST_SEED=<seed>); every output buffer is NaN-poisoned, so that a column the kernel
fails to write, or writes past D, shows.

    PYTHONPATH=. python -m pytest -q -m gpu tests/gpu/test_head_dims_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

import helpers
import omnicupy
from omnicupy import BlockMask, jit, reference
from omnicupy.dispatch import tiles
from omnicupy.dispatch.arch import has_wgmma
from omnicupy.ops import decode, tma

from decode_cases import compare, paged_from_contiguous
from helpers import TOLERANCE, run_and_check, random_qkv, seed_note, seeded_rng

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

FORWARD_HEAD_DIMS = (8, 40, 80, 136, 160, 192, 248)
BACKWARD_HEAD_DIMS = (40, 80, 192)
DECODE_HEAD_DIMS = (40, 80, 192)
FAMILIES = ("sync", "wgmma", "tma")


def device_arch() -> str:
    return jit.device_arch()


def seed() -> int:
    """The seed of this test's inputs (helpers.seeded_rng printed it), for decode_cases.compare."""
    return helpers.last_seed[1]


def require_family(family: str, head_dim: int) -> None:
    """Skip the family where the device or the head dim has none (wgmma/tma: sm_90, and a head dim whose
    Hopper tile is mma.sync's; tma also needs cuda-bindings)."""
    if family == "sync":
        return
    if not has_wgmma(device_arch()):
        pytest.skip(f"{family} needs sm_90 (device {device_arch()})")
    if tiles.hopper_head_dim(head_dim) is None:
        pytest.skip(f"head dim {head_dim} stays on mma.sync (the {family} tile would pad more)")
    if family == "tma" and not tma.available():
        pytest.skip("tma needs cuda-bindings")


def document_mask(rng, n: int):
    """Documents of random lengths (causal inside each): PARTIAL blocks on the boundaries."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [n]]))
    ids = omnicupy.masks.doc_ids_from_lengths(lengths)
    mod = omnicupy.masks.document(ids, causal=True)
    bm = BlockMask.from_mask_mod(mod, None, None, n, n, q_block_size=128, kv_block_size=128)
    return bm, reference.dense_mask_from_mod(mod, 1, 1, n, n)


def mask_for(kind: str, rng, n: int):
    """(block_mask, causal, dense element mask [1, 1, n, n])."""
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    if kind == "full":
        return None, False, np.ones((1, 1, n, n), bool)
    if kind == "causal":
        return None, True, (qi >= ki)[None, None]
    assert kind == "document", kind
    bm, dense = document_mask(rng, n)
    assert bm.features.partial, "the document mask must exercise PARTIAL blocks"
    return bm, False, dense


# ---------------------------------------------------------------- forward
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask_kind", ["full", "causal", "document"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", FORWARD_HEAD_DIMS)
def test_forward(monkeypatch, head_dim, dtype, mask_kind, family):
    require_family(family, head_dim)
    monkeypatch.setenv("OMNICUPY_MMA", family)
    rng = seeded_rng()
    B, H, N = 2, 3, 333  # odd: the last q and kv tiles are partial
    q, k, v = random_qkv(rng, B, H, N, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, N)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    plan = omnicupy.plan(qd, kd, vd, bm, causal=causal)
    assert plan.variant.family == family and plan.variant.real_head_dim == head_dim, plan.describe()
    assert plan.variant.padded
    # stored PARTIAL bits (the precompiled kernels); the fused expression is test_forward_fused_mask's
    run_and_check(q, k, v, dense, dtype, block_mask=bm, causal=causal, fuse_mask=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", [40, 192])
def test_forward_fused_mask(monkeypatch, head_dim, family):
    """The document mask's expression evaluated in PARTIAL blocks instead of stored bits."""
    require_family(family, head_dim)
    monkeypatch.setenv("OMNICUPY_MMA", family)
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 333, head_dim, "bf16")
    bm, causal, dense = mask_for("document", rng, 333)
    run_and_check(q, k, v, dense, "bf16", block_mask=bm, fuse_mask=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", [40, 192])
def test_forward_cross_lengths_and_gqa(monkeypatch, head_dim, family):
    """q and kv of different odd lengths, grouped kv heads, a [B, N, H, D] strided layout."""
    require_family(family, head_dim)
    monkeypatch.setenv("OMNICUPY_MMA", family)
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 4, 77, head_dim, "fp16", Hkv=2, Nkv=301)
    run_and_check(q, k, v, np.ones((1, 1, 77, 301), bool), "fp16", layout="bnhd")


def test_padded_output_columns_are_not_written_past_d():
    """out as a view of the first D columns of a wider buffer: the columns past D stay poisoned."""
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 200, 40, "fp16")
    wide = cp.full((1, 2, 200, 64), 7.0, dtype=cp.float16)
    out = wide[..., :40]
    omnicupy.attention(*(cp.asarray(x) for x in (q, k, v)), causal=True, out=out)
    assert bool(cp.all(wide[..., 40:] == 7.0)), "a padded kernel wrote past the caller's head dim" + seed_note()
    want = reference.attention(q, k, v, np.tril(np.ones((200, 200), bool))[None, None])
    err = reference.relative_error(out.get().astype(np.float64), want)
    assert err <= TOLERANCE["fp16"], f"relative error {err:.2e}" + seed_note()


# ---------------------------------------------------------------- backward
def check_backward(rng, q, k, v, dense, dtype, *, block_mask=None, causal=False):
    """attention_backward into NaN-poisoned dq/dk/dv against reference.attention_backward; out and
    lse from the float64 reference (this checks the backward alone)."""
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    want_out, want_lse = reference.attention(q, k, v, dense, return_lse=True)
    qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
    out = cp.asarray(want_out.astype(q.dtype))
    lse = cp.asarray(want_lse.astype(np.float32))
    grads = {n: cp.full(x.shape, np.nan, dtype=x.dtype) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    got = omnicupy.attention_backward(dod, qd, kd, vd, out, lse, block_mask, causal=causal, **grads)
    want = reference.attention_backward(dout, q, k, v, dense)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g is grads[name], f"{name} was not written in place"
        g = g.get().astype(np.float64)
        assert not np.isnan(g).any(), f"{name}: unwritten or NaN elements" + seed_note()
        err = reference.relative_error(g, w)
        assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e} > {TOLERANCE[dtype]}" + seed_note()


@pytest.mark.parametrize("mask_kind", ["full", "causal", "document"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
def test_backward(head_dim, dtype, mask_kind):
    rng = seeded_rng()
    B, H, N = 1, 2, 333
    q, k, v = random_qkv(rng, B, H, N, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, N)
    check_backward(rng, q, k, v, dense, dtype, block_mask=bm, causal=causal)


@pytest.mark.parametrize("head_dim", BACKWARD_HEAD_DIMS)
def test_backward_gqa_from_the_forward(head_dim):
    """Grouped kv heads, out and lse from omnicupy.attention itself (the padded forward feeds the
    padded backward)."""
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 4, 257, head_dim, "fp16", Hkv=2)
    dense = np.tril(np.ones((257, 257), bool))[None, None]
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    qd, kd, vd, dod = (cp.asarray(x) for x in (q, k, v, dout))
    out, lse = omnicupy.attention(qd, kd, vd, causal=True, return_lse=True)
    got = omnicupy.attention_backward(dod, qd, kd, vd, out, lse, causal=True)
    want = reference.attention_backward(dout, q, k, v, dense)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = reference.relative_error(g.get().astype(np.float64), w)
        assert err <= TOLERANCE["fp16"], f"{name}: relative error {err:.2e}" + seed_note()


# ---------------------------------------------------------------- decode, paged, varlen
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", DECODE_HEAD_DIMS)
def test_decode(head_dim, dtype, splits):
    """Split-KV decode with ragged kv_lens; 3 splits go through the combine kernel."""
    rng = seeded_rng()
    B, Hq, Hkv, Nq, Nkv = 3, 8, 2, 2, 777
    q, k, v = random_qkv(rng, B, Hq, Nq, head_dim, dtype, Hkv=Hkv, Nkv=Nkv)
    kv_lens = np.array([777, 1, 301], np.int32)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = decode.decode_attention(*(cp.asarray(x) for x in (q, k, v)), kv_lens=cp.asarray(kv_lens),
                                       num_splits=splits, causal=True, return_lse=True, out=out)
    assert got is out
    want, want_lse = reference.decode_attention(q, k, v, kv_lens, causal="bottom_right", return_lse=True)
    compare(got, lse, want, want_lse, dtype, f"decode D={head_dim} splits={splits}", seed())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim", DECODE_HEAD_DIMS)
def test_paged(head_dim, layout):
    rng = seeded_rng()
    B, Hq, Hkv, Nq = 2, 8, 2, 3
    lens = np.array([333, 50], np.int32)
    q, k, v = random_qkv(rng, B, Hq, Nq, head_dim, "bf16", Hkv=Hkv, Nkv=int(lens.max()))
    kp, vp, table = paged_from_contiguous(rng, k, v, 16, layout, lens)
    want, want_lse = reference.paged_attention(q, kp, vp, table, lens, causal=True, return_lse=True, layout=layout)
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = omnicupy.paged_attention(*(cp.asarray(x) for x in (q, kp, vp, table, lens)), causal=True,
                                        return_lse=True, out=out, layout=layout, num_splits=2)
    assert got is out
    compare(got, lse, want, want_lse, "bf16", f"paged D={head_dim} {layout}", seed())
    assert decode.take_device_errors() == 0


@pytest.mark.parametrize("head_dim", DECODE_HEAD_DIMS)
def test_varlen(head_dim):
    rng = seeded_rng()
    q_lens, Hq, Hkv = [1, 130, 77], 4, 2
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q4, k4, v4 = random_qkv(rng, 1, Hq, int(cu[-1]), head_dim, "fp16", Hkv=Hkv)
    q, k, v = (np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (q4, k4, v4))
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = omnicupy.varlen_attention(*(cp.asarray(x) for x in (q, k, v)), cp.asarray(cu), cp.asarray(cu),
                                         causal=True, return_lse=True, out=out)
    assert got is out
    want, want_lse = reference.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    compare(got.transpose(1, 0, 2), lse, want.transpose(1, 0, 2), want_lse, "fp16", f"varlen D={head_dim}",
            seed())
