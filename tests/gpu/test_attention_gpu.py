"""The forward kernel against the float64 reference on a GPU.

Every case draws fresh random inputs, poisons the output buffer with NaN, and compares the whole
output (and LSE where asked) with omnicupy.reference computed from the element-level mask.
"""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy.dispatch.arch import has_wgmma
import omnicupy
from omnicupy import BlockMask, jit, reference
from omnicupy.dispatch import schedule, tiles
from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS

from helpers import TOLERANCE, random_block_mask, random_qkv, run_and_check, seed_note, seeded_rng

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")


def mask_for(kind, rng, B, H, q_len, kv_len, qbs=128, kbs=128):
    """(block_mask, causal flag, dense element mask broadcastable to [B, H, Nq, Nkv])."""
    qi, ki = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if kind == "full":
        return None, False, np.ones((1, 1, q_len, kv_len), bool)
    if kind == "causal":
        return None, True, (qi >= ki)[None, None]
    if kind == "mixed":  # a different random mix of all four block types per (b, h)
        bm, dense = random_block_mask(rng, B, H, q_len, kv_len, qbs, kbs, empty_q_blocks=1, shuffle=True)
        return bm, False, dense
    raise ValueError(kind)


# ---------------------------------------------------------------- every variant
@pytest.mark.parametrize("mask_kind", ["full", "causal", "mixed"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_variant(head_dim, dtype, stages, mask_kind):
    rng = seeded_rng()
    B, H, N = 2, 2, 300
    q, k, v = random_qkv(rng, B, H, N, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, B, H, N, N)
    run_and_check(q, k, v, dense, dtype, block_mask=bm, causal=causal, stages=stages)


# ---------------------------------------------------------------- lengths and tails
@pytest.mark.parametrize("n", [1, 17, 127, 1000, 4097])
@pytest.mark.parametrize("mask_kind", ["causal", "mixed"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("head_dim,dtype", [(64, "fp16"), (128, "bf16")])
def test_sequence_lengths(n, mask_kind, stages, head_dim, dtype):
    rng = seeded_rng()
    B, H = (1, 2) if n > 1000 else (2, 2)
    q, k, v = random_qkv(rng, B, H, n, head_dim, dtype)
    bm, causal, dense = mask_for(mask_kind, rng, B, H, n, n)
    run_and_check(q, k, v, dense, dtype, block_mask=bm, causal=causal, stages=stages)


@pytest.mark.parametrize("q_len,kv_len", [(1, 300), (300, 1), (77, 1000), (1000, 77), (129, 4000)])
@pytest.mark.parametrize("mask_kind", ["full", "causal", "mixed"])
def test_cross_lengths(q_len, kv_len, mask_kind):
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 2, q_len, 64, "fp16", Nkv=kv_len)
    bm, causal, dense = mask_for(mask_kind, rng, 2, 2, q_len, kv_len)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm, causal=causal)


# ---------------------------------------------------------------- block sizes and layouts
@pytest.mark.parametrize("qbs,kbs", [(64, 64), (128, 256), (256, 128), (64, 512), (128, 32), (16, 32)])
@pytest.mark.parametrize("stages", [1, 2])
def test_block_sizes(qbs, kbs, stages):
    """kv blocks wider than the tile are walked as several tiles; small blocks pick smaller tiles."""
    rng = seeded_rng()
    n = 1000
    q, k, v = random_qkv(rng, 1, 2, n, 128, "fp16")
    bm, dense = random_block_mask(rng, 1, 2, n, n, qbs, kbs, empty_q_blocks=1, shuffle=True)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm, stages=stages)


@pytest.mark.parametrize("bcast", ["both", "batch", "heads", "none"])
def test_broadcast_masks(bcast):
    rng = seeded_rng()
    B, H, n = 3, 4, 500
    Bm = 1 if bcast in ("both", "batch") else B
    Hm = 1 if bcast in ("both", "heads") else H
    q, k, v = random_qkv(rng, B, H, n, 64, "fp16")
    bm, dense = random_block_mask(rng, Bm, Hm, n, n, 128, 128, empty_q_blocks=1)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm)


@pytest.mark.parametrize("layout", ["bnhd", "reversed"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stages", [1, 2])
def test_strided_inputs(head_dim, stages, layout):
    """Views with other strides: [B, N, H, D] buffers, and negative sequence strides ([:, :, ::-1])."""
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 3, 333, head_dim, "fp16")
    bm, causal, dense = mask_for("mixed", rng, 2, 3, 333, 333)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm, stages=stages, layout=layout)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_grouped_query_heads(hq, hkv):
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, hq, 400, 64, "fp16", Hkv=hkv)
    bm, causal, dense = mask_for("mixed", rng, 2, hq, 400, 400)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm)


def test_all_rows_empty():
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 200, 64, "fp16")
    grid = np.zeros((1, 1, 2, 2), np.int32)
    bm = BlockMask.from_block_types(grid, q_len=200, kv_len=200)
    run_and_check(q, k, v, np.zeros((1, 1, 200, 200), bool), "fp16", block_mask=bm)


def test_custom_scale():
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 300, 64, "fp16")
    run_and_check(q, k, v, np.ones((1, 1, 300, 300), bool), "fp16", scale=0.05)


# ---------------------------------------------------------------- array interop
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_numpy_in_numpy_out(dtype):
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 257, 64, dtype)
    out = omnicupy.attention(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == q.dtype
    qi, ki = np.arange(257)[:, None], np.arange(257)[None, :]
    err = reference.relative_error(out.astype(np.float64), reference.attention(q, k, v, qi >= ki))
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}" + seed_note()
    out2, lse = omnicupy.attention(q, k, v, causal=True, return_lse=True, out=np.empty_like(q))
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32
    np.testing.assert_array_equal(out2.astype(np.float32), out.astype(np.float32), err_msg=seed_note())


def test_torch_dlpack_zero_copy():
    torch = pytest.importorskip("torch")
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 2, 300, 64, "fp16")
    tq, tk, tv = (torch.from_numpy(x.astype(np.float16)).cuda() for x in (q, k, v))
    out_t = torch.full_like(tq, float("nan"))
    got = omnicupy.attention(tq, tk, tv, causal=True, out=out_t)
    assert got.data.ptr == out_t.data_ptr(), "out must be written in place, zero-copy"
    qi, ki = np.arange(300)[:, None], np.arange(300)[None, :]
    err = reference.relative_error(out_t.cpu().numpy(), reference.attention(q, k, v, qi >= ki))
    assert err <= TOLERANCE["fp16"], f"relative error {err:.2e}" + seed_note()
    bq = tq.to(torch.bfloat16)
    got_bf16 = omnicupy.attention(bq, tk.to(torch.bfloat16), tv.to(torch.bfloat16), causal=True)
    assert got_bf16.dtype == omnicupy.arrays.BFLOAT16


def test_low_level_call():
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 2, 300, 128, "fp16")
    bm, dense = random_block_mask(rng, 2, 2, 300, 300, 128, 128, empty_q_blocks=1)
    o = cp.full(q.shape, np.nan, dtype=q.dtype)
    lse = cp.full(q.shape[:3], np.nan, dtype=np.float32)
    omnicupy.omni_attn_mma_blockmask(
        cp.asarray(q), cp.asarray(k), cp.asarray(v), o, cp.asarray(bm.kv_num_blocks), cp.asarray(bm.kv_indices),
        cp.asarray(bm.block_mask_types), 2, partial_block_mask_indices=cp.asarray(bm.partial_block_mask_indices),
        partial_block_masks=cp.asarray(bm.partial_block_masks), lse=lse)
    want, want_lse = reference.attention(q, k, v, dense, return_lse=True)
    err = reference.relative_error(o.get(), want)
    assert err <= TOLERANCE["fp16"], f"relative error {err:.2e}" + seed_note()
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse.get()[finite], want_lse[finite], atol=2e-3, err_msg="LSE" + seed_note())


@pytest.mark.parametrize("corrupt,message", [
    (lambda idx, nb: idx.__setitem__((0, 0, 0, 0), 99), "outside"),
    (lambda idx, nb: nb.__setitem__((0, 0, 0), 5), "larger than"),
    (lambda idx, nb: idx.__setitem__((0, 0, 1, 1), int(idx[0, 0, 1, 0])), "twice"),
])
def test_device_metadata_is_validated_on_device(corrupt, message):
    bm = BlockMask.causal(300, 300)
    nb, idx, types = (cp.asarray(a).copy() for a in (bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types))
    corrupt(idx, nb)
    with pytest.raises(omnicupy.MaskError, match=message):
        BlockMask(nb, idx, types, q_len=300, kv_len=300)


# ---------------------------------------------------------------- every built-in mask
from mask_cases import MASK_CASES  # noqa: E402


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("q_len,kv_len,block", [(777, 777, 128), (300, 1000, 64), (1000, 300, 128)])
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_builtin_masks(factory, q_len, kv_len, block, stages):
    """Each built-in mask through from_mask_mod (on the GPU) against the reference evaluated from the
    mask_mod itself (on the host), per (b, h) with B = 2, H = 2."""
    rng = seeded_rng()
    mask_mod = factory(q_len, kv_len)
    bm = BlockMask.from_mask_mod(mask_mod, None, None, q_len, kv_len, q_block_size=block, kv_block_size=block)
    q, k, v = random_qkv(rng, 2, 2, q_len, 64, "fp16", Nkv=kv_len)
    dense = reference.dense_mask_from_mod(mask_mod, 1, 1, q_len, kv_len)
    run_and_check(q, k, v, dense, "fp16", block_mask=bm, stages=stages)


# ---------------------------------------------------------------- variant options and launch order
@pytest.mark.parametrize("mask_kind", ["causal", "mixed"])
@pytest.mark.parametrize("family,head_dim,tile", [
    ("sync", 128, tiles.Tile(128, 64, 4, poly_exp=8)),
    ("wgmma", 64, tiles.Tile(64, 128, 4, poly_exp=4)),
    ("wgmma", 128, tiles.Tile(128, 128, 8, poly_exp=8)),
])
def test_exp2_on_the_fma_pipe(monkeypatch, family, head_dim, tile, mask_kind):
    """poly_exp variants (part of the exps from a polynomial): same accuracy, empty rows still 0."""
    if family == "wgmma" and not has_wgmma(jit.device_arch()):
        pytest.skip("wgmma needs sm_90")
    monkeypatch.setenv("OMNICUPY_MMA", family)
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 2, 700, head_dim, "fp16")
    bm, causal, dense = mask_for(mask_kind, rng, 2, 2, 700, 700)
    with tiles.use_tiles({(head_dim, 2): tile}, family=family):
        chosen = tiles.select_variant(head_dim, "fp16", 2, 128, 128, causal or mask_kind == "mixed",
                                      mask_kind == "mixed", arch=jit.device_arch())
        assert chosen.poly_exp == tile.poly_exp
        run_and_check(q, k, v, dense, "fp16", block_mask=bm, causal=causal, stages=2)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_launch_order_does_not_change_results(monkeypatch, head_dim):
    """Packed documents get a heaviest-first q tile order; every tile still runs exactly once, and
    the output is bitwise that of the default order."""
    rng = seeded_rng()
    ids = np.repeat(np.arange(5), [200, 900, 64, 700, 136])
    n = ids.size
    bm = BlockMask.from_mask_mod(omnicupy.masks.document(ids, causal=True), None, None, n, n)
    assert schedule.launch_order(bm, 64) is not None
    q, k, v = random_qkv(rng, 2, 2, n, head_dim, "fp16")
    dense = reference.dense_mask_from_mod(omnicupy.masks.document(ids, causal=True), 1, 1, n, n)
    _, lpt = run_and_check(q, k, v, dense, "fp16", block_mask=bm)
    monkeypatch.setenv("OMNICUPY_SCHEDULE", "natural")
    _, natural = run_and_check(q, k, v, dense, "fp16", block_mask=bm)
    np.testing.assert_array_equal(lpt, natural, err_msg=seed_note())
