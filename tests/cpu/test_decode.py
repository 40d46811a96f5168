"""Split-KV decode, paged caches and ragged batches on the CPU: argument checks (before any launch),
page-table validation, planning (row packing, split heuristic, shared memory), the kernels'
parameter structs and compiles, and the float64 reference paths checked against each other.

The GPU side (every path against these references) is tests/gpu/test_decode_gpu.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, BlockMask, KVCacheError, NoGPUError, masks, reference, score_mods
from omnicupy import jit
from omnicupy.dispatch.params import COMBINE, DECODE, STRUCTS
from omnicupy.dispatch.variant import Variant
from omnicupy.jit.cache import DiskCache
from omnicupy.ops import decode, varlen
from omnicupy.ops.inputs import check_qkv
from omnicupy.ops.paged import check_cache_metadata

from decode_cases import paged_from_contiguous

F16 = np.float16


def zeros(*shape, dtype=F16):
    return np.zeros(shape, dtype=dtype)


# ------------------------------------------------------------------------------- argument checks
def paged_args(**over):
    """A valid paged call: B 2, Hq 8, Hkv 2, Nq 3, D 64, 6 pages of 16, 3 pages per sequence."""
    args = {"q": zeros(2, 8, 3, 64), "k_pages": zeros(6, 16, 2, 64), "v_pages": zeros(6, 16, 2, 64),
            "page_table": np.array([[0, 1, 2], [3, 4, -1]], np.int32), "kv_lens": np.array([40, 20], np.int32)}
    args.update(over)
    return args


BAD_PAGED = [
    pytest.param(paged_args(q=zeros(2, 8, 64)), {}, ArgumentError, "q must be 4-D", id="q-ndim"),
    pytest.param(paged_args(k_pages=zeros(6, 16, 2, 64, dtype=np.float32)), {}, ArgumentError, "k_pages must be float16",
                 id="k-dtype"),
    pytest.param(paged_args(v_pages=zeros(6, 16, 2, 32)), {}, ArgumentError, "same shape", id="v-shape"),
    pytest.param(paged_args(k_pages=zeros(6, 16, 2, 32), v_pages=zeros(6, 16, 2, 32)), {}, ArgumentError,
                 "head_dim", id="head-dim"),
    pytest.param(paged_args(k_pages=zeros(6, 16, 3, 64), v_pages=zeros(6, 16, 3, 64)), {}, ArgumentError,
                 "multiple of the cache's kv heads", id="gqa"),
    pytest.param(paged_args(k_pages=zeros(16, 2, 64), v_pages=zeros(16, 2, 64)), {}, ArgumentError, "4-D", id="pages-ndim"),
    pytest.param(paged_args(), {"layout": "NDH"}, ArgumentError, "layout", id="layout"),
    pytest.param(paged_args(page_table=np.zeros((3, 3), np.int32)), {}, ArgumentError, "page_table must be", id="table-batch"),
    pytest.param(paged_args(page_table=np.zeros((2, 0), np.int32)), {}, ArgumentError, "max_pages >= 1", id="table-empty"),
    pytest.param(paged_args(page_table=np.zeros((2, 3), np.float32)), {}, ArgumentError, "integer", id="table-dtype"),
    pytest.param(paged_args(kv_lens=np.array([1, 2, 3], np.int32)), {}, ArgumentError, "length B=2", id="lens-shape"),
    pytest.param(paged_args(kv_lens=np.array([1.0, 2.0])), {}, ArgumentError, "integer", id="lens-dtype"),
    pytest.param(paged_args(kv_lens=None), {}, ArgumentError, "kv_lens is required", id="lens-none"),
    pytest.param(paged_args(kv_lens=np.array([49, 1], np.int32)), {}, KVCacheError, r"\[0, 48\]", id="lens-beyond-table"),
    pytest.param(paged_args(kv_lens=np.array([-1, 1], np.int32)), {}, KVCacheError, "kv_lens", id="lens-negative"),
    pytest.param(paged_args(page_table=np.array([[0, 1, 6], [3, 4, 5]], np.int32)), {}, KVCacheError,
                 r"page_table\[0, 2\] = 6", id="page-beyond-pool"),
    pytest.param(paged_args(page_table=np.array([[0, 1, 2], [-3, 4, 5]], np.int32)), {}, KVCacheError,
                 r"page_table\[1, 0\] = -3", id="page-negative"),
    pytest.param(paged_args(), {"window": 0}, ArgumentError, "window", id="window-zero"),
    pytest.param(paged_args(), {"window": 2.5}, ArgumentError, "window", id="window-float"),
    pytest.param(paged_args(), {"causal": "bottom_right"}, ArgumentError, "causal", id="causal-str"),
    pytest.param(paged_args(), {"num_splits": 0}, ArgumentError, "num_splits", id="splits-zero"),
    pytest.param(paged_args(), {"num_splits": 1000}, ArgumentError, "num_splits", id="splits-many"),
    pytest.param(paged_args(), {"scale": -1.0}, ArgumentError, "scale", id="scale"),
    pytest.param(paged_args(), {"score_mod": lambda s, b, h, q, k: s}, ArgumentError, "score_mods", id="score-mod-lambda"),
    pytest.param(paged_args(), {"out": zeros(2, 8, 3, 32)}, ArgumentError, "out must have shape", id="out-shape"),
]


@pytest.mark.parametrize("args,kwargs,error,match", BAD_PAGED)
def test_paged_rejects_bad_input_before_launch(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        omnicupy.paged_attention(*args.values(), **kwargs)


def test_paged_good_input_reaches_the_gpu_check():
    """Padding entries (-1) past a sequence's last page are legal: a valid call gets as far as the GPU."""
    if omnicupy.arrays.gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(NoGPUError):
        omnicupy.paged_attention(*paged_args().values())


def decode_args(B=2, Hq=8, Hkv=2, Nq=1, Nkv=50, D=64):
    return zeros(B, Hq, Nq, D), zeros(B, Hkv, Nkv, D), zeros(B, Hkv, Nkv, D)


BAD_DECODE = [
    pytest.param({"kv_lens": np.array([1, 2, 3], np.int32)}, ArgumentError, "length B=2", id="lens-shape"),
    pytest.param({"kv_lens": np.array([51, 2], np.int32)}, KVCacheError, r"\[0, 50\]", id="lens-beyond-cache"),
    pytest.param({"kv_lens": np.array([5, 2], np.int32), "causal": "top_left"}, ArgumentError, "bottom-right",
                 id="lens-top-left"),
    pytest.param({"kv_lens": np.array([5, 2], np.int32), "causal": "sideways"}, ArgumentError, "causal", id="causal-bad"),
    pytest.param({"num_splits": -2}, ArgumentError, "num_splits", id="splits-negative"),
    pytest.param({"num_splits": True}, ArgumentError, "num_splits", id="splits-bool"),
    pytest.param({"block_mask": BlockMask.full(1, 50), "causal": True}, ArgumentError, "either block_mask", id="mask-and-causal"),
    pytest.param({"block_mask": BlockMask.full(1, 40)}, omnicupy.MaskError, "kv_len=40", id="mask-kv-len"),
    pytest.param({"block_mask": "causal"}, ArgumentError, "BlockMask", id="mask-type"),
    pytest.param({"score_mod": "softcap"}, ArgumentError, "score_mods", id="score-mod"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_DECODE)
def test_decode_rejects_bad_input_before_launch(kwargs, error, match):
    with pytest.raises(error, match=match):
        decode.decode_attention(*decode_args(), **kwargs)


def test_decode_plan_refuses_what_it_cannot_serve_when_asked():
    q, k, v = decode_args(Nq=200, Nkv=300)
    inp = check_qkv(q, k, v)
    lens = np.array([300, 10], np.int32)
    with pytest.raises(ArgumentError, match="bias"):
        decode.decode_plan(inp, None, lens, None, bias=np.zeros((2, 8, 300), F16), arch="sm_90")
    with pytest.raises(ArgumentError, match="q_block_size"):
        decode.decode_plan(inp, BlockMask.full(200, 300), lens, None, arch="sm_90")
    # Not asked for (no kv_lens, no num_splits): the forward kernel runs instead.
    assert decode.decode_plan(inp, BlockMask.full(200, 300), None, None, arch="sm_90") is None
    assert decode.decode_plan(inp, None, None, None, arch="sm_90") is None
    assert decode.decode_plan(inp, None, None, None, bias=np.zeros((2, 8, 300), F16), arch="sm_90") is None


# ------------------------------------------------------------------------------------- planning
ROW_PACKING = [
    pytest.param(4, 1, True, decode.Rows(16, 4, 1, 1, 1), id="gqa4-decode"),
    pytest.param(4, 4, True, decode.Rows(16, 4, 4, 1, 1), id="gqa4-nq4"),
    pytest.param(4, 16, True, decode.Rows(64, 4, 16, 1, 1), id="gqa4-nq16"),
    pytest.param(4, 300, True, decode.Rows(64, 4, 16, 1, 19), id="gqa4-chunk300"),
    pytest.param(1, 33, True, decode.Rows(64, 1, 33, 1, 1), id="mha-nq33"),
    pytest.param(8, 5, False, decode.Rows(16, 1, 5, 8, 8), id="per-head-mask"),
    pytest.param(128, 1, True, decode.Rows(64, 64, 1, 2, 2), id="group128"),
    pytest.param(6, 20, True, decode.Rows(64, 6, 10, 1, 2), id="group6-nq20"),
]


@pytest.mark.parametrize("group,q_len,shared,want", ROW_PACKING)
def test_pack_rows(group, q_len, shared, want):
    rows = decode.pack_rows(group, q_len, shared)
    assert rows == want
    assert rows.heads_per_tile * rows.q_per_tile <= rows.br
    # every (head, position) of the group lands in exactly one tile row
    seen = set()
    for tile in range(rows.m_tiles):
        hb, qb = tile % rows.head_blocks, tile // rows.head_blocks
        for r in range(rows.heads_per_tile * rows.q_per_tile):
            h, i = hb * rows.heads_per_tile + r // rows.q_per_tile, qb * rows.q_per_tile + r % rows.q_per_tile
            if h < group and i < q_len:
                assert (h, i) not in seen
                seen.add((h, i))
    assert len(seen) == (group if shared else group) * q_len


SPLITS = [
    pytest.param(8, 4096, 4, 1, 132, False, 16, id="b1-128k"),
    pytest.param(8, 256, 4, 1, 132, False, 16, id="b1-8k"),
    pytest.param(64, 4096, 4, 1, 132, False, 2, id="b8"),
    pytest.param(256, 4096, 4, 1, 132, False, 1, id="b32"),
    pytest.param(256, 4096, 4, 1, 132, True, 3, id="b32-ragged-four-waves"),
    pytest.param(256, 256, 4, 1, 132, True, 1, id="b32-ragged-8k-keeps-long-splits"),
    pytest.param(8, 4096, 4, 1, 132, True, 16, id="b1-ragged-one-wave-is-enough"),
    pytest.param(8, 4, 4, 1, 132, True, 1, id="short-cache"),
    pytest.param(8, 40, 4, 1, 132, False, 5, id="bounded-by-length"),
]


@pytest.mark.parametrize("units,tiles,groups,per_sm,sms,ragged,want", SPLITS)
def test_split_heuristic(units, tiles, groups, per_sm, sms, ragged, want):
    assert decode.choose_splits(units, tiles, groups, per_sm, sms, ragged) == want


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("br", [16, 32, 64])
def test_decode_tiles_fit_the_arch(arch, head_dim, br):
    v = decode.decode_variant(head_dim, "fp16", br, causal=True, partial=False, score_expr=None, arch=arch)
    assert v.runs_on(arch) and v.br == br and v.warps % (br // 16) == 0


def test_decode_plan_describes_itself_and_splits_on_request():
    q, k, v = decode_args(B=1, Hq=32, Hkv=8, Nq=1, Nkv=8192, D=128)
    inp = check_qkv(q, k, v)
    p = decode.decode_plan(inp, None, None, None, arch="sm_90", num_sms=132)
    assert p.num_splits > 1 and p.split.grid[0] == 8 * p.num_splits
    # the splits merged by the last CTA of each unit (FUSED_COMBINE) or by a combine launch
    assert (p.combine is None) == p.fused == decode.FUSED_COMBINE
    assert "split-KV decode" in p.describe() and p.kernels[0].startswith("omni_decode_fp16_hd128_br16")
    two = decode.plan_split_kv(head_dim=128, dtype="fp16", batch=1, heads=32, kv_heads=8, q_len=1, longest=8192,
                               rows=decode.pack_rows(4, 1), rule=decode.Rule(), arch="sm_90", num_sms=132,
                               fused_combine=False)
    assert two.num_splits > 1 and two.combine is not None and not two.fused and "combine" in two.describe()
    one = decode.decode_plan(inp, None, None, 1, arch="sm_90")
    assert one.num_splits == 1 and one.combine is None
    win = decode.plan_split_kv(head_dim=128, dtype="fp16", batch=1, heads=32, kv_heads=8, q_len=1,
                               longest=decode.rule_span(decode.Rule(True, 4096, True), 1, 131072),
                               rows=decode.pack_rows(4, 1), rule=decode.Rule(True, 4096, True), arch="sm_90",
                               num_sms=132)
    full = decode.plan_split_kv(head_dim=128, dtype="fp16", batch=1, heads=32, kv_heads=8, q_len=1, longest=131072,
                                rows=decode.pack_rows(4, 1), rule=decode.Rule(True, 0, True), arch="sm_90", num_sms=132)
    assert win.num_splits <= full.num_splits


def test_decode_variant_validation():
    with pytest.raises(ValueError, match="br"):
        Variant(128, "fp16", 48, 32, 4, 3, operation="decode")
    with pytest.raises(ValueError, match="stages"):
        Variant(128, "fp16", 16, 32, 4, 1, operation="decode")
    with pytest.raises(ValueError, match="bc"):
        Variant(128, "fp16", 16, 64, 4, 3, operation="decode")
    with pytest.raises(ValueError, match="multiple"):
        Variant(128, "fp16", 64, 32, 2, 3, operation="decode")
    with pytest.raises(ValueError, match="combine"):
        Variant(128, "fp16", 8, 32, 4, 1, operation="combine")
    v = Variant(128, "bf16", 32, 32, 4, 3, True, operation="decode")
    assert v.name == "omni_decode_bf16_hd128_br32_bc32_w4_st3_causal" and v.kv_groups == 2
    assert decode.combine_variant(64, "fp16").name == "omni_combine_fp16_hd64_br4_bc32_w4_st1"


# --------------------------------------------------------------------------------- ABI and compiles
def _param_offsets(struct, name):
    """The byte offsets at which the PTX of the struct's probe kernel reads its parameter."""
    from omnicupy.jit.compiler import compile_ptx

    ptx = compile_ptx(struct.probe_kernel(name), name=name, arch="compute_80")
    found = set()
    # ld.param[.v2|.v4].<type><bits> {..}, [name_param_0+off]: a vector load reads consecutive fields
    for m in re.finditer(rf"ld\.param(?:\.v(\d))?\.[a-z](\d+)\s+[^\[]*\[{name}_param_0(?:\+(\d+))?\]", ptx):
        lanes, bits, at = int(m.group(1) or 1), int(m.group(2)), int(m.group(3) or 0)
        found.update(at + i * bits // 8 for i in range(lanes))
    return found


@pytest.mark.parametrize("operation", ["decode", "combine"])
def test_param_struct_layout_matches_nvrtc(operation):
    struct = STRUCTS[operation]
    want = set()
    for p in struct.params:
        for i in range(p.count):
            want.add(struct.offset(p.name) + i * p.size)
    assert _param_offsets(struct, f"probe_{operation}") == want


def test_decode_structs_are_registered():
    assert STRUCTS["decode"] is DECODE and STRUCTS["combine"] is COMBINE
    assert "struct DecodeParams" in DECODE.cpp() and "struct CombineParams" in COMBINE.cpp()


COMPILED = [
    Variant(128, "fp16", 16, 32, 4, 3, operation="decode"),
    Variant(128, "bf16", 16, 32, 4, 3, True, operation="decode"),
    Variant(128, "fp16", 32, 32, 4, 3, True, True, operation="decode"),
    Variant(128, "fp16", 64, 32, 8, 3, True, False, score_expr=score_mods.softcap(30.0).cuda.key, operation="decode"),
    Variant(64, "bf16", 64, 32, 8, 3, True, True, score_expr=score_mods.alibi(8).cuda.key, operation="decode"),
    Variant(32, "fp16", 32, 32, 4, 4, True, True, operation="decode"),
    Variant(96, "fp16", 64, 32, 8, 3, True, True, operation="decode"),
    Variant(256, "bf16", 16, 32, 2, 3, True, True, operation="decode"),
    Variant(256, "fp16", 64, 32, 4, 3, True, False, operation="decode"),
    decode.combine_variant(128, "fp16"), decode.combine_variant(96, "bf16"), decode.combine_variant(256, "fp16"),
]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("decode-kernel-cache"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("variant", COMPILED, ids=lambda v: v.name)
def test_decode_kernels_compile_without_spills(variant, arch, compile_cache):
    entry, _ = jit.build(variant, arch, cache=compile_cache)
    assert entry.meta["kernel"] == variant.name
    assert entry.meta["spill_bytes"] == 0, f"{variant.name} spills {entry.meta['spill_bytes']} bytes"


# ----------------------------------------------------------------------------- metadata checks
def test_cache_metadata_checks_only_pages_in_use():
    table = np.array([[5, -1, 99], [0, 1, 2]], np.int32)
    check_cache_metadata(table, np.array([16, 48], np.int32), 16, 6)  # row 0 uses one page: the rest is padding
    with pytest.raises(KVCacheError, match=r"page_table\[0, 1\]"):
        check_cache_metadata(table, np.array([17, 48], np.int32), 16, 6)
    with pytest.raises(KVCacheError, match="kv_lens"):
        check_cache_metadata(table, np.array([17, 49], np.int32), 16, 6)


# ------------------------------------------------------------------------------ reference paths
def _random(rng, *shape, dtype=F16):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [16, 24, 64])
def test_reference_paged_equals_contiguous(layout, page_size):
    rng = np.random.default_rng(page_size)
    B, Hq, Hkv, Nq, N, D = 3, 4, 2, 3, 100, 16
    q, k, v = _random(rng, B, Hq, Nq, D), _random(rng, B, Hkv, N, D), _random(rng, B, Hkv, N, D)
    lens = np.array([100, 0, 37], np.int32)
    kp, vp, table = paged_from_contiguous(rng, k, v, page_size, layout, lens)
    for kwargs in ({"causal": True}, {"causal": False}, {"causal": True, "window": 7},
                   {"causal": True, "score_mod": score_mods.softcap(5.0)}):
        got, lse = reference.paged_attention(q, kp, vp, table, lens, layout=layout, return_lse=True, **kwargs)
        causal = "bottom_right" if kwargs["causal"] else False
        mod = kwargs.get("score_mod")
        want, want_lse = reference.decode_attention(q, k, v, lens, causal=causal, window=kwargs.get("window"),
                                                    score_mod=mod, return_lse=True)
        np.testing.assert_allclose(got, want, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        assert np.all(got[1] == 0) and np.all(np.isneginf(lse[1]))  # the empty sequence


def test_reference_decode_rules():
    rng = np.random.default_rng(1)
    B, H, Nq, N, D = 2, 2, 4, 30, 8
    q, k, v = _random(rng, B, H, Nq, D), _random(rng, B, H, N, D), _random(rng, B, H, N, D)
    lens = np.array([30, 2], np.int32)
    # bottom-right per sequence: the same as the plain reference on the sliced cache with an offset causal mask
    got, lse = reference.decode_attention(q, k, v, lens, causal=True, return_lse=True)
    for b, L in enumerate(lens):
        want = reference.attention(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], masks.causal(int(L) - Nq))
        np.testing.assert_allclose(got[b:b + 1], want, atol=1e-12)
    assert np.all(np.isneginf(lse[1, :, :2])) and np.all(np.isfinite(lse[1, :, 2:]))  # L = 2 < Nq = 4
    # top-left, no lengths: the plain causal reference
    np.testing.assert_allclose(reference.decode_attention(q, k, v, causal="top_left"),
                               reference.attention(q, k, v, masks.causal()), atol=1e-12)
    # a window: the sliding-window mask shifted to the bottom-right
    win = reference.decode_attention(q, k, v, None, causal=True, window=5)
    shifted = masks.sliding_window(5)
    np.testing.assert_allclose(win, reference.attention(q, k, v, lambda b, h, i, j: shifted(b, h, i + N - Nq, j)),
                               atol=1e-12)
    # score modifiers see the row index in decode_attention, the position in paged_attention; ALiBi
    # depends on kv_idx - q_idx only up to a constant per row, so both agree
    alibi = score_mods.alibi(H)
    got = reference.decode_attention(q, k, v, lens, causal=True, score_mod=alibi)
    kp, vp, table = paged_from_contiguous(rng, k, v, 16, "NHD", lens)
    np.testing.assert_allclose(reference.paged_attention(q, kp, vp, table, lens, score_mod=alibi), got, atol=1e-9)
    # ... while a modifier that reads q_idx itself tells them apart
    by_row = score_mods.cuda_score("score * (1.0f + 0.1f * q_idx)", numpy_fn=lambda s, b, h, i, j: s * (1 + 0.1 * i))
    assert not np.allclose(reference.paged_attention(q, kp, vp, table, lens, score_mod=by_row),
                           reference.decode_attention(q, k, v, lens, causal=True, score_mod=by_row))


VARLEN = [
    pytest.param([0, 5, 5, 40, 41], [0, 5, 5, 40, 41], True, id="self-causal-with-empty"),
    pytest.param([0, 5, 5, 40, 41], [0, 5, 5, 40, 41], False, id="self-full"),
    pytest.param([0, 3, 10, 30], [0, 8, 9, 40], True, id="cross-causal"),
    pytest.param([0, 3, 10, 30], [0, 0, 9, 40], False, id="cross-empty-keys"),
]


@pytest.mark.parametrize("cu_q,cu_k,causal", VARLEN)
def test_varlen_mask_and_reference(cu_q, cu_k, causal):
    cu_q, cu_k = np.array(cu_q), np.array(cu_k)
    rng = np.random.default_rng(len(cu_q))
    Hq, Hkv, D = 4, 2, 8
    q, k, v = _random(rng, cu_q[-1], Hq, D), _random(rng, cu_k[-1], Hkv, D), _random(rng, cu_k[-1], Hkv, D)
    # The dense rule, built here independently
    dense = np.zeros((cu_q[-1], cu_k[-1]), bool)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        dense[cu_q[s]:cu_q[s + 1], cu_k[s]:cu_k[s + 1]] = (i + lk - lq >= j) if causal else True
    bm = varlen.varlen_mask(cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), causal)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], dense)
    mod = varlen.ragged_mask(cu_q.astype(np.int64), cu_k.astype(np.int64), causal)
    np.testing.assert_array_equal(reference.dense_mask_from_mod(mod, 1, 1, cu_q[-1], cu_k[-1])[0, 0], dense)
    got, lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    want, want_lse = reference.attention(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                         v.transpose(1, 0, 2)[None], dense, return_lse=True)
    np.testing.assert_allclose(got, want[0].transpose(1, 0, 2), atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[0], atol=1e-12)


BAD_VARLEN = [
    pytest.param({"cu_seqlens_q": np.array([0, 5, 9])}, "end at 10", id="cu-q-total"),
    pytest.param({"cu_seqlens_q": np.array([1, 5, 10])}, "start at 0", id="cu-q-start"),
    pytest.param({"cu_seqlens_k": np.array([0, 7, 6, 12])}, "never decrease", id="cu-k-decreasing"),
    pytest.param({"cu_seqlens_k": np.array([0, 12])}, "as many sequences", id="count-mismatch"),
    pytest.param({"cu_seqlens_k": np.array([[0, 12]])}, "1-D", id="cu-ndim"),
    pytest.param({"q": zeros(1, 10, 4, 8)}, "3-D", id="q-ndim"),
    pytest.param({"causal": "bottom_right"}, "causal", id="causal-str"),
]


@pytest.mark.parametrize("over,match", BAD_VARLEN)
def test_varlen_rejects_bad_input(over, match):
    args = {"q": zeros(10, 4, 8), "k": zeros(12, 2, 8), "v": zeros(12, 2, 8),
            "cu_seqlens_q": np.array([0, 4, 10]), "cu_seqlens_k": np.array([0, 7, 12])}
    kwargs = {}
    for key, value in over.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(ArgumentError, match=match):
        omnicupy.varlen_attention(*args.values(), **kwargs)


def test_varlen_without_keys_needs_no_launch():
    q = np.ones((6, 2, 8), F16)
    out, lse = omnicupy.varlen_attention(q, zeros(0, 1, 8), zeros(0, 1, 8), np.array([0, 6]), np.array([0, 0]),
                                         return_lse=True)
    assert out.shape == q.shape and np.all(out == 0) and lse.shape == (2, 6) and np.all(np.isneginf(lse))


# ------------------------------------------------------------------- plan(), fused combine, tiles
def test_omnicupy_plan_describes_the_decode_kernel():
    """omnicupy.plan() answers with the DecodePlan wherever attention() would take the decode kernel."""
    q, k = zeros(8, 32, 1, 128), zeros(8, 8, 4096, 128)
    plan = omnicupy.plan(q, k, k, causal="bottom_right", arch="sm_90")
    assert isinstance(plan, decode.DecodePlan) and "decode:" in str(plan)
    lens = np.array([4096, 100, 1, 0, 4096, 7, 8, 9], np.int32)
    assert omnicupy.plan(q, k, k, kv_lens=lens, causal=True, arch="sm_90").rule.bottom_right
    assert omnicupy.plan(q, k, k, num_splits=5, arch="sm_90").num_splits == 5
    long_q = zeros(1, 4, 300, 64)  # 300 query rows: the forward kernel
    assert not isinstance(omnicupy.plan(long_q, long_q, long_q, causal=True, arch="sm_90"), decode.DecodePlan)


@pytest.mark.parametrize("splits,fused,want_fused", [
    pytest.param(7, True, True, id="fused"),
    pytest.param(7, False, False, id="combine-kernel"),
    pytest.param(1, True, False, id="one-split-needs-no-merge"),
])
def test_fused_combine_plans_no_combine_kernel(splits, fused, want_fused):
    plan = decode.plan_split_kv(head_dim=128, dtype="fp16", batch=2, heads=8, kv_heads=2, q_len=1, longest=1000,
                                rows=decode.pack_rows(4, 1), rule=decode.Rule(causal=True, bottom_right=True),
                                num_splits=splits, arch="sm_90", fused_combine=fused)
    assert plan.fused == want_fused
    assert (plan.combine is None) == (want_fused or splits == 1)
    assert ("last CTA" in str(plan)) == want_fused


@pytest.mark.parametrize("name,value,what,want", [
    pytest.param("DECODE_TILES", decode.DECODE_TILES.updated({(128, 16): (2, 3)}),
                 lambda p: p.split.variant.warps, (4, 2), id="tile-table"),
    pytest.param("FUSED_COMBINE", False, lambda p: (p.fused, p.combine is None), ((True, True), (False, False)),
                 id="fused-combine"),
    pytest.param("MIN_TILES_PER_GROUP", 64, lambda p: p.num_splits > 1, (True, False), id="min-tiles-per-group"),
    pytest.param("MAX_SPLITS", 2, lambda p: p.num_splits <= 2, (False, True), id="max-splits"),
])
def test_plan_follows_the_tunables(monkeypatch, name, value, what, want):
    """Tuning tools and tests change the module's tunables between calls (decode.settings()): the
    cached plan must follow each of them."""
    kw = dict(head_dim=128, dtype="fp16", batch=1, heads=32, kv_heads=8, q_len=1, longest=8192,
              rows=decode.pack_rows(4, 1), rule=decode.Rule(causal=True, bottom_right=True), arch="sm_90")
    before = decode.plan_split_kv(**kw)
    monkeypatch.setattr(decode, name, value)
    after = decode.plan_split_kv(**kw)
    assert (what(before), what(after)) == want
    if name == "DECODE_TILES":
        assert after.split.smem_bytes < 115_000  # two CTAs per SM: the heuristic counts them


def test_tile_table_is_read_only_and_hashable():
    """DECODE_TILES is part of hashed keys (decode.settings()): changed by rebinding, never in place."""
    table = decode.DECODE_TILES
    changed = table.updated({(128, 16): (2, 3)})
    assert table[(128, 16)] == (4, 3) and changed[(128, 16)] == (2, 3) and len(changed) == len(table)
    assert changed != table and changed == decode.TileTable({**dict(table), (128, 16): (2, 3)})
    assert hash(changed) == hash(decode.TileTable(dict(changed))) and {changed: 1}[decode.TileTable(dict(changed))] == 1
    with pytest.raises(TypeError):
        table[(128, 16)] = (2, 3)
