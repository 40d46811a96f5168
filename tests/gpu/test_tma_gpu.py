"""The tma forward family (Hopper, sm_90a) on a GPU against the float64 reference.

Every test forces the family with OMNICUPY_MMA=tma, checks that the plan really is a tma kernel
(or, where TMA cannot address the inputs, that the call still answers correctly on the wgmma
family), and compares output and LSE with omnicupy.reference on seeded inputs (the seed is in
every assertion message). Skipped without an sm_90 GPU.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, score_mods
from omnicupy.dispatch import tiles
from omnicupy.dispatch.arch import has_wgmma
from omnicupy.ops import tma
from omnicupy.ops.forward import Extras, make_plan, resolve_mask
from omnicupy.ops.inputs import check_qkv, on_device

from helpers import random_block_mask, random_qkv, run_and_check

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

HEAD_DIMS = (64, 128, 256)
#: The three pipelines of the family, each as the tile the tests force.
PIPELINES = {
    "plain": lambda hd: tiles.Tile(128, tiles.TMA_TUNED[(hd, 2)].bc, 12),
    "overlap": lambda hd: tiles.Tile(128, tiles.TMA_TUNED[(hd, 2)].bc, 12, overlap=True),
    "pingpong": lambda hd: tiles.Tile(128, tiles.TMA_TUNED[(hd, 2)].bc, 12, overlap=True, pingpong=True),
}


@pytest.fixture(autouse=True)
def tma_family(monkeypatch):
    if not omnicupy.arrays.gpu_available() or not has_wgmma(omnicupy.jit.device_arch()):
        pytest.skip("the tma family needs an sm_90 GPU")
    if not tma.available():
        pytest.skip("cuda-bindings is not installed: the tma family falls back to wgmma")
    monkeypatch.setenv("OMNICUPY_MMA", "tma")


def planned_family(q, k, v, bm, **kw) -> str:
    """The family attention() runs for device copies of q, k, v (after ops/tma.py's checks)."""
    inp = on_device(check_qkv(q, k, v))
    extras = Extras(bias=kw.get("bias"), score_expr=kw.get("score_expr"))
    return make_plan(inp, resolve_mask(bm, False, inp), None, extras, omnicupy.jit.device_arch()).variant.family


def check(seed, q, k, v, dense, dtype, **kw):
    try:
        return run_and_check(q, k, v, dense, dtype, **kw)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None


# ---------------------------------------------------------------- every block type, every pipeline
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_random_block_types_each_pipeline(pipeline, hd):
    """MASKED, CAUSAL, FULL and PARTIAL blocks in shuffled order, an empty q block, odd lengths."""
    seed = 1000 + hd + len(pipeline)
    rng = np.random.default_rng(seed)
    n = 517
    bm, dense = random_block_mask(rng, 2, 2, n, n, 128, 128, empty_q_blocks=1, shuffle=True)
    q, k, v = random_qkv(rng, 2, 2, n, hd, "fp16")
    with tiles.use_tiles({(hd, 2): PIPELINES[pipeline](hd)}, family="tma"):
        plan = omnicupy.plan(q, k, v, bm)
        assert plan.variant.family == "tma" and plan.variant.overlap == (pipeline != "plain"), plan
        check(seed, q, k, v, dense, "fp16", block_mask=bm)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("mask", ["full", "causal", "causal-bottom-right", "random"])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_shipped_tiles(hd, mask, dtype):
    """The tuned tile of each head dim on every mask feature combination, tails on both ends."""
    seed = zlib.crc32(f"{hd}-{mask}-{dtype}".encode())
    rng = np.random.default_rng(seed)
    nq, nkv = 389, 261
    q, k, v = random_qkv(rng, 1, 3, nq, hd, dtype, Nkv=nkv)
    qi, ki = np.arange(nq)[:, None], np.arange(nkv)[None, :]
    bm, causal = None, False
    if mask == "full":
        dense = np.ones((nq, nkv), bool)
    elif mask == "causal":
        dense, causal = qi >= ki, True
    elif mask == "causal-bottom-right":
        dense, causal = qi + nkv - nq >= ki, "bottom_right"
    else:
        bm, dense = random_block_mask(rng, 1, 3, nq, nkv, 128, 128, empty_q_blocks=1)
    if bm is None:
        assert omnicupy.plan(q, k, v, causal=causal).variant.family == "tma"
    else:
        assert omnicupy.plan(q, k, v, bm).variant.family == "tma"
    check(seed, q, k, v, dense, dtype, block_mask=bm, causal=causal)


# ---------------------------------------------------------------- rule masks on the 192-row tile
# (q_len, kv_len, heads, kv heads), the kv length raised by the entry's min_kv_len: tails of every
# size against 192-row q blocks, Nq != Nkv both ways, GQA and MQA, one q block
RULE_SHAPES = [
    pytest.param(389, 261, 3, 3, id="tails"),
    pytest.param(577, 1000, 8, 2, id="gqa-more-keys"),
    pytest.param(192, 700, 4, 1, id="mqa-one-block"),
    pytest.param(1153, 1153, 2, 2, id="square"),
]
RULE_ENTRIES = [pytest.param(hd, rule, e.min_kv_len, id=f"d{hd}-{rule}")
                for (hd, _, rule), e in tiles.TMA_RULE_TILES.items()]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("nq,nkv,hq,hkv", RULE_SHAPES)
@pytest.mark.parametrize("hd,rule,min_kv", RULE_ENTRIES)
def test_rule_masks_on_the_rule_tile(hd, rule, min_kv, nq, nkv, hq, hkv, dtype):
    """BlockMask.full / causal as built (128-row q blocks), planned on tiles.TMA_RULE_TILES through a
    re-blocked copy: the plan says so, the output and LSE match float64, a second call (the recorded
    launch) too."""
    nkv += min_kv
    seed = zlib.crc32(f"rule-{hd}-{rule}-{nq}-{nkv}-{hq}-{dtype}".encode())
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, hq, nq, hd, dtype, Hkv=hkv, Nkv=nkv)
    bm = BlockMask.full(nq, nkv) if rule == "full" else BlockMask.causal(nq, nkv)
    plan = omnicupy.plan(q, k, v, bm)
    assert (plan.variant.family, plan.variant.br) == ("tma", 192), plan.variant.name
    assert plan.block_mask is not None and plan.block_mask.q_block_size == 192
    for _ in range(2):
        check(seed, q, k, v, bm.to_dense(), dtype, block_mask=bm)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("nq,nkv,hq,hkv", RULE_SHAPES)
@pytest.mark.parametrize("hd", sorted({hd for hd, _ in tiles.TMA_BLOCK_TILES}))
def test_masks_built_at_192_row_blocks(hd, nq, nkv, hq, hkv, dtype):
    """Random blocks of every type (PARTIAL included, empty q blocks) on 192-row q blocks run
    tiles.TMA_BLOCK_TILES' tile as they are (no re-blocking) and match float64."""
    seed = zlib.crc32(f"blocks192-{hd}-{nq}-{nkv}-{hq}-{dtype}".encode())
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 2, hq, nq, hd, dtype, Hkv=hkv, Nkv=nkv)
    bm, dense = random_block_mask(rng, 1, hq, nq, nkv, 192, 128, empty_q_blocks=1)
    plan = omnicupy.plan(q, k, v, bm)
    assert (plan.variant.family, plan.variant.br, plan.block_mask) == ("tma", 192, None), plan.variant.name
    check(seed, q, k, v, dense, dtype, block_mask=bm)


# ---------------------------------------------------------------- shapes and layouts
@pytest.mark.parametrize("hq,hkv", [pytest.param(8, 2, id="gqa"), pytest.param(4, 1, id="mqa")])
@pytest.mark.parametrize("hd", [64, 128])
def test_gqa_and_cross_lengths(hq, hkv, hd):
    seed = 7 * hq + hkv + hd
    rng = np.random.default_rng(seed)
    nq, nkv = 200, 555
    q, k, v = random_qkv(rng, 2, hq, nq, hd, "fp16", Hkv=hkv, Nkv=nkv)
    bm, dense = random_block_mask(rng, 1, hq, nq, nkv, 128, 128)
    assert omnicupy.plan(q, k, v, bm).variant.family == "tma"
    check(seed, q, k, v, dense, "fp16", block_mask=bm)


def test_small_q_blocks_use_the_one_consumer_tile():
    seed = 64
    rng = np.random.default_rng(seed)
    n = 333
    bm, dense = random_block_mask(rng, 1, 2, n, n, 64, 64, empty_q_blocks=1)
    q, k, v = random_qkv(rng, 1, 2, n, 128, "fp16")
    variant = omnicupy.plan(q, k, v, bm).variant
    assert (variant.family, variant.br, variant.bc) == ("tma", 64, 64)
    check(seed, q, k, v, dense, "fp16", block_mask=bm)


@pytest.mark.parametrize("layout,family", [pytest.param("bnhd", "tma", id="bnhd-view"),
                                           pytest.param("reversed", "wgmma", id="negative-strides")])
def test_strided_views(layout, family):
    """A [B, N, H, D] buffer viewed as BHND is a TMA tensor; negative strides are not (wgmma runs)."""
    seed = 99
    rng = np.random.default_rng(seed)
    n = 300
    q, k, v = random_qkv(rng, 2, 3, n, 128, "fp16")
    if layout == "reversed":
        view = cp.asarray(np.ascontiguousarray(q[:, :, ::-1]))[:, :, ::-1]
        assert tma.unusable(tiles.select_variant(128, "fp16", None, 128, 128, True, False, arch="sm_90"),
                            {"q": view}, "fp16") is not None
    else:
        qd = cp.ascontiguousarray(cp.asarray(q).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        assert planned_family(qd, qd, qd, None) == family
    check(seed, q, k, v, np.arange(n)[:, None] >= np.arange(n)[None, :], "fp16", causal=True, layout=layout)


# ---------------------------------------------------------------- per-score work
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_bias_and_score_modifier_run_the_plain_pipeline(hd):
    seed = 500 + hd
    rng = np.random.default_rng(seed)
    n = 290
    q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16")
    bias = (rng.standard_normal((1, 2, n, n)) * 2).astype(np.float32)
    mod = score_mods.softcap(5.0)
    dense = np.arange(n)[:, None] >= np.arange(n)[None, :]
    variant = omnicupy.plan(q, k, v, causal=True, bias=bias, score_mod=mod).variant
    assert variant.family == "tma" and not variant.overlap and not variant.pingpong
    check(seed, q, k, v, dense, "fp16", causal=True, bias=bias, score_mod=mod)


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_fused_mask_expression(hd):
    seed = 900 + hd
    rng = np.random.default_rng(seed)
    n = 411
    doc = (np.arange(n) // 53).astype(np.int32)
    mask = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", arrays={"doc": doc},
                              numpy_fn=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki))
    bm = BlockMask.from_mask_mod(mask, None, None, n, n)
    q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16")
    dense = (doc[:, None] == doc[None, :]) & (np.arange(n)[:, None] >= np.arange(n)[None, :])
    assert omnicupy.plan(q, k, v, bm, fuse_mask=True).variant.family == "tma"
    check(seed, q, k, v, dense, "fp16", block_mask=bm, fuse_mask=True)


# ---------------------------------------------------------------- steady state
def test_cached_calls_follow_new_buffers():
    """The per-signature recipe writes the tensor maps of each call's pointers (new buffers, new maps)."""
    seed = 4242
    rng = np.random.default_rng(seed)
    n, hd = 384, 128
    dense = np.arange(n)[:, None] >= np.arange(n)[None, :]
    for _ in range(3):
        q, k, v = random_qkv(rng, 1, 2, n, hd, "fp16")
        qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
        for _ in range(2):  # the second call is the recipe's
            out = omnicupy.attention(qd, kd, vd, causal=True)
            want = omnicupy.reference.attention(q, k, v, dense)
            err = omnicupy.reference.relative_error(out.get(), want)
            assert err <= 3e-3, f"seed {seed}: relative error {err:.2e}"
