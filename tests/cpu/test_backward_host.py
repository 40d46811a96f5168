"""The backward pass's host side, without a GPU: the transposed block index (against a brute-force
transpose of the forward metadata), the deterministic dQ turns, argument checks before any launch,
tile selection, and NVRTC compiles of every shipped backward variant for sm_80 and sm_90."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, BlockType, arrays, jit, score_mods
from omnicupy.dispatch import tiles
from omnicupy.dispatch.tiles import BwdTile
from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS, Variant
from omnicupy.errors import ArgumentError, MaskError, NoGPUError, VariantError
from omnicupy.jit.cache import DiskCache
from omnicupy.mask import cdiv
from omnicupy.ops.backward_index import ranks, transpose

from helpers import random_block_mask, random_qkv


# ---------------------------------------------------------------- transposed index
def brute_force(bm: BlockMask):
    """{(b, h, kv block): [(q block, type, partial index), ...] in increasing q order}."""
    nb, idx, types = bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types
    pidx = bm.partial_block_mask_indices
    out: dict = {}
    Bm, Hm, nqb, _ = idx.shape
    for b, h in np.ndindex(Bm, Hm):
        for kb in range(bm.num_kv_blocks):
            out[b, h, kb] = []
        for qb in range(nqb):
            for e in range(int(nb[b, h, qb])):
                t = int(types[b, h, qb, e])
                if t != BlockType.MASKED:
                    out[b, h, int(idx[b, h, qb, e])].append((qb, t, 0 if pidx is None else int(pidx[b, h, qb, e])))
    return {key: sorted(v) for key, v in out.items()}


INDEX_CASES = [
    pytest.param(1, 1, 300, 300, 128, 128, False, id="one-row-300"),
    pytest.param(2, 3, 1000, 700, 128, 64, True, id="batch-heads-shuffled"),
    pytest.param(1, 2, 97, 1500, 32, 256, True, id="short-q-long-kv"),
    pytest.param(3, 1, 512, 512, 64, 64, False, id="batch-only"),
]


@pytest.mark.parametrize("Bm,Hm,q_len,kv_len,qbs,kbs,shuffle", INDEX_CASES)
def test_transposed_index_matches_brute_force(Bm, Hm, q_len, kv_len, qbs, kbs, shuffle):
    seed = q_len * 31 + kv_len
    rng = np.random.default_rng(seed)
    bm, _ = random_block_mask(rng, Bm, Hm, q_len, kv_len, qbs, kbs, empty_q_blocks=1, shuffle=shuffle)
    index = transpose(bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, bm.partial_block_mask_indices,
                      bm.num_kv_blocks)
    want = brute_force(bm)
    for (b, h, kb), entries in want.items():
        row = b * index.row_stride_batch + h * index.row_stride_head + kb
        n = int(index.q_num_blocks[row])
        got = [(int(index.q_indices[row, s]), int(index.q_types[row, s]),
                0 if index.q_partial_index is None else int(index.q_partial_index[row, s])) for s in range(n)]
        assert got == entries, f"seed {seed}, row {(b, h, kb)}"


@pytest.mark.parametrize("kv_tile", [32, 64])
def test_dq_turns_go_down_the_kv_tiles(kv_tile):
    """The turns rank - t of one q block's kv tiles are 0, 1, 2, ... in decreasing kv tile order,
    with no gap or repeat (the kernel's deterministic dQ order)."""
    seed = 4242 + kv_tile
    rng = np.random.default_rng(seed)
    kv_len, kbs = 1000, 128  # the last kv block is cut by kv_len: it has fewer tiles
    bm, _ = random_block_mask(rng, 2, 2, 700, kv_len, 128, kbs, empty_q_blocks=1, shuffle=True)
    index = transpose(bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types, bm.partial_block_mask_indices,
                      bm.num_kv_blocks)
    rank = ranks(index, kv_len, kbs, kv_tile)
    kv_tiles = cdiv(kv_len, kv_tile)
    turns: dict = {}
    for (b, h, kb), entries in brute_force(bm).items():
        row = b * index.row_stride_batch + h * index.row_stride_head + kb
        for s, (qb, _, _) in enumerate(entries):
            first_tile = kb * (kbs // kv_tile)
            for t in range(kbs // kv_tile):
                if first_tile + t < kv_tiles:
                    turns.setdefault((b, h, qb), []).append((first_tile + t, int(rank[row, s]) - t))
    for key, pairs in turns.items():
        pairs.sort(reverse=True)  # last kv tile first
        assert [turn for _, turn in pairs] == list(range(len(pairs))), f"seed {seed}, q row {key}"


# ---------------------------------------------------------------- argument checks (no GPU needed)
def _inputs(rng, B=1, Hq=2, Hkv=2, Nq=40, Nkv=40, D=64):
    q, k, v = random_qkv(rng, B, Hq, Nq, D, "fp16", Hkv=Hkv, Nkv=Nkv)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out = np.zeros_like(q)
    lse = np.zeros((B, Hq, Nq), np.float32)
    return dout, q, k, v, out, lse


def _call(**changes):
    rng = np.random.default_rng(0)
    dout, q, k, v, out, lse = _inputs(rng)
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    kwargs = {n: changes.pop(n) for n in list(changes) if n not in args}
    args.update(changes)
    return omnicupy.attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **kwargs)


BAD_CALLS = [
    pytest.param(dict(dout=np.zeros((1, 2, 41, 64), np.float16)), ArgumentError, "dout", id="dout-shape"),
    pytest.param(dict(dout=np.zeros((1, 2, 40, 64), np.float32)), ArgumentError, "dout", id="dout-dtype"),
    pytest.param(dict(out=np.zeros((1, 2, 40, 32), np.float16)), ArgumentError, "out", id="out-shape"),
    pytest.param(dict(lse=None), ArgumentError, "lse is required", id="lse-missing"),
    pytest.param(dict(lse=np.zeros((1, 2, 39), np.float32)), ArgumentError, "lse", id="lse-shape"),
    pytest.param(dict(lse=np.zeros((1, 2, 40), np.float64)), ArgumentError, "lse", id="lse-dtype"),
    pytest.param(dict(block_mask=BlockMask.causal(64, 64)), MaskError, "q_len=64", id="mask-other-lengths"),
    pytest.param(dict(causal="diagonal"), ArgumentError, "causal", id="bad-causal"),
    pytest.param(dict(score_mod=omnicupy.cuda_score("score * 2.0f")), ArgumentError, "derivative",
                 id="score-mod-without-grad"),
    pytest.param(dict(dk=np.zeros((1, 2, 40, 32), np.float16)), ArgumentError, "dk", id="dk-shape"),
    pytest.param(dict(dv=np.zeros((1, 2, 40, 64), np.float32)), ArgumentError, "dv", id="dv-dtype"),
    pytest.param(dict(deterministic="yes"), ArgumentError, "deterministic", id="deterministic-not-bool"),
    pytest.param(dict(scale=-1.0), ArgumentError, "scale", id="negative-scale"),
    pytest.param(dict(bias=np.zeros((1, 2, 41), np.float32)), ArgumentError, "bias", id="bias-shape"),
]


@pytest.mark.parametrize("changes,error,match", BAD_CALLS)
def test_bad_input_is_named_before_launch(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


@pytest.mark.skipif(arrays.gpu_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, deterministic=True),
                                    dict(score_mod=score_mods.softcap(5.0), bias=np.zeros((1, 1, 40), np.float32))])
def test_valid_call_passes_every_check(kwargs):
    """A valid NumPy call passes every check and stops only for want of a GPU."""
    with pytest.raises(NoGPUError):
        _call(**kwargs)


# ---------------------------------------------------------------- tiles and variants
def test_backward_plan_without_gpu():
    rng = np.random.default_rng(1)
    _, q, k, v, _, _ = _inputs(rng, B=2, Hq=4, Hkv=2, Nq=300, Nkv=500, D=256)
    plan = omnicupy.ops.backward.plan(q, k, v, causal=True, arch="sm_90")
    assert plan.variant.operation == "backward" and plan.kernel.startswith("omni_bwd_fp16_hd256")
    assert plan.grid == (cdiv(500, plan.variant.bc) * 2, 2, 2)  # two column passes at D = 256
    assert plan.smem_bytes == plan.variant.smem_bytes <= 227 * 1024


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("qbs,kbs", [(128, 128), (64, 64), (16, 32), (48, 96), (256, 512)])
def test_backward_tile_divides_blocks_and_fits(head_dim, qbs, kbs):
    for arch in ("sm_80", "sm_86", "sm_90"):
        v = tiles.select_backward_variant(head_dim, "bf16", qbs, kbs, True, True, arch=arch)
        assert qbs % v.br == 0 and kbs % v.bc == 0 and v.runs_on(arch)
        if v.family == "sync":  # the mma.sync kernel's rules; the wgmma ones are Variant's own checks
            assert tiles.BwdTile(v.br, v.bc, v.warps, v.stages).fits(head_dim)
        else:
            assert arch == "sm_90" and head_dim in tiles.WGMMA_BACKWARD_TILES


def test_backward_tables_fit_their_head_dims():
    for table in (tiles.BACKWARD_TILES, tiles.BACKWARD_FEATURE_TILES):
        for head_dim, tile in table.items():
            assert tile.fits(head_dim), (head_dim, tile)
            assert tiles.backward_variant(tile, head_dim, "fp16", True, True).runs_on("sm_90")


def test_score_grad_is_part_of_the_name():
    sc = score_mods.softcap(3.0)
    a = tiles.select_backward_variant(64, "fp16", 128, 128, False, False, score_expr=sc.cuda.key, score_grad="1.0f")
    b = tiles.select_backward_variant(64, "fp16", 128, 128, False, False, score_expr=sc.cuda.key,
                                      score_grad=sc.cuda_grad.text)
    assert a.name != b.name and a != b


def test_backward_warps_split_kv_rows():
    with pytest.raises(ValueError, match="bc=32"):
        Variant(64, "fp16", 64, 32, 4, 2, operation="backward")
    Variant(64, "fp16", 16, 64, 4, 2, operation="backward")  # q tiles of 16 rows are fine


@pytest.mark.parametrize("head_dim,tile,problem", [
    (64, BwdTile(64, 128, 8, parts=2), None), (32, BwdTile(64, 128, 8, parts=2), None),
    (64, BwdTile(64, 64, 4, parts=2), None), (64, BwdTile(32, 128, 8, parts=2), None),
    (128, BwdTile(64, 128, 8, parts=2), None), (128, BwdTile(32, 32, 2, parts=2), None),
    (64, BwdTile(16, 32, 2, parts=2), "br a multiple of 32"),  # q parts of 8 columns: not a k16 step
    (64, BwdTile(64, 128, 4, parts=2), "32 kv rows per warp"),  # 32 kv rows per warp already
    (96, BwdTile(64, 128, 8, parts=2), "up to 64 or 128"), (256, BwdTile(32, 64, 4, parts=2), "up to 64 or 128"),
    (64, BwdTile(64, 128, 8, parts=3), "one or two"),
])
def test_q_parts_where_registers_allow(head_dim, tile, problem):
    # kernels/bwd_kv_tile.cuh kQSplit: two q parts need dK and dV of two m16 tiles per warp in
    # registers (whole at D <= 64, by halves of the columns at 128) and an even split of the tile
    assert tile.fits(head_dim) == (problem is None)
    if problem:
        with pytest.raises(VariantError, match=problem):
            tiles.backward_variant(tile, head_dim, "fp16", False, False)
        return
    variant = tiles.backward_variant(tile, head_dim, "fp16", False, False)
    assert variant.parts == 2 and variant.name.endswith("_qp2") and variant.column_parts == (head_dim == 128)
    source = jit.render.render_source(variant)
    assert "kQSplit = 2;" in source and f"kColumnParts = {str(variant.column_parts).lower()};" in source


def test_q_parts_are_the_sync_backward_only():
    with pytest.raises(VariantError, match="mma.sync backward option"):
        Variant(64, "fp16", 64, 64, 4, 2, operation="backward", family="wgmma", parts=2)
    with pytest.raises(VariantError, match="mma.sync backward option"):
        Variant(64, "fp16", 64, 64, 4, 2, parts=2)


@pytest.mark.parametrize("head_dim,arch,parts", [(64, "sm_90", 2), (128, "sm_90", 2), (64, "sm_80", 2),
                                                  (128, "sm_80", 1), (64, "sm_86", 2)])
def test_tuned_tile_keeps_its_rows_where_two_parts_do_not_fit(head_dim, arch, parts):
    # the two-part D = 128 tile keeps Pᵀ in shared memory too (173 KB): on sm_80 the same tile runs with one part
    variant = tiles.select_backward_variant(head_dim, "fp16", 128, 128, True, False, arch=arch, family="sync")
    assert (variant.br, variant.bc, variant.warps, variant.parts) == (64, 128, 8, parts)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("feature", [dict(bias="fp16"), dict(score_expr=score_mods.alibi(2).cuda.key, score_grad="1.0f")])
def test_one_q_part_with_transformed_scores(head_dim, feature):
    # a bias or score modifier's registers made the two-part kernels spill or run slower (lab/notes/backward.md#s40)
    variant = tiles.select_backward_variant(head_dim, "fp16", 128, 128, False, False, arch="sm_90", family="sync",
                                            **feature)
    assert variant.parts == 1 and not variant.column_parts


# ---------------------------------------------------------------- compiles
SHIPPED = tiles.shipped_backward_variants()
FEATURES = [
    tiles.backward_variant(tiles.BACKWARD_FEATURE_TILES[hd], hd, "bf16", True, True, bias="fp32",
                           score_expr=score_mods.softcap(5.0).cuda.key,
                           score_grad=score_mods.softcap(5.0).cuda_grad.text)
    for hd in SUPPORTED_HEAD_DIMS
] + [
    tiles.backward_variant(tiles.BACKWARD_TILES[64], 64, "fp16", True, True,
                           mask_expr=omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]",
                                                        arrays={"doc": np.zeros(8, np.int32)}).cuda.key,
                           score_expr=score_mods.alibi(4).cuda.key, score_grad=score_mods.UNIT_GRAD),
    *[tiles.backward_variant(t, hd, "fp16", False, True) for t in tiles.BACKWARD_FALLBACKS for hd in (64, 128)],
]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("bwd-kernel-cache"))


BUILDS = [(v, arch) for v in SHIPPED for arch in ("sm_80", "sm_90") if v.family == "sync" or arch == "sm_90"] + [
    (v, "sm_90") for v in FEATURES]


@pytest.mark.parametrize("variant,arch", BUILDS, ids=lambda x: getattr(x, "name", x))
def test_backward_variant_compiles(variant, arch, compile_cache):
    entry, _ = jit.build(variant, arch, cache=compile_cache)
    assert entry.meta["kernel"] == variant.name and entry.size > 1000
    source = jit.render.render_source(variant)
    for suffix in ("_pre", "", "_dq") + (("_det",) if variant.family == "wgmma" else ()):
        assert "void __launch_bounds__(" in source and f" {variant.name}{suffix}(const __grid_constant__ BwdParams params)" in source


def test_steady_state_writes_pointers_in_the_recipes_order(monkeypatch):
    """The cached backward call hands the recipe its pointers in POINTER_FIELDS' order (q, k, v, o,
    dout, lse, dq, dk, dv, then the workspace): _steady_key's views through _launch_if_known."""
    from types import SimpleNamespace

    from omnicupy.ops import backward, recall

    seen = {}

    class FakeRecipe:
        workspace = SimpleNamespace(allocate=lambda cp: (None, (0xA0, 0xB0, 0xC0, 0)))

        def launch(self, *pointers):
            seen["pointers"] = pointers

    monkeypatch.setattr(recall, "recipe_for", lambda mask, key: FakeRecipe())

    class FakeArray:  # what recall.view reads of a CuPy array
        def __init__(self, ptr, shape):
            self.data = SimpleNamespace(ptr=ptr, device_id=0)
            self.shape, self.strides, self.dtype = shape, tuple(2 * n for n in (shape[1] * shape[2] * shape[3],
                                                                               shape[2] * shape[3], shape[3], 1)), "f2"

    cp = SimpleNamespace(ndarray=FakeArray, cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 0)))
    names = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv")
    arrays = {n: FakeArray(0x1000 * (i + 1), (1, 1, 16, 64)) for i, n in enumerate(names)}
    grads = (arrays["dq"], arrays["dk"], arrays["dv"])  # user buffers: their view's pointer is used
    a = arrays
    key, mask, views = backward._steady_key(a["dout"], a["q"], a["k"], a["v"], a["o"], a["lse"], grads, None, True,
                                            None, None, None, False, False, cp)
    assert key is not None and mask is not None
    result = backward._launch_if_known(mask, key, views, grads, cp)
    assert result == grads
    by_name = {n: x.data.ptr for n, x in arrays.items()}
    expected = tuple(by_name[n] for n in backward.POINTER_FIELDS[:9]) + (0xA0, 0xB0, 0xC0, 0)
    assert seen["pointers"] == expected


def test_inputs_line_up_in_pointer_order():
    """The steady state's views and the first call's check that its recipe fits later calls (nothing
    was copied) both take the arrays from _in_pointer_order: it must be POINTER_FIELDS' order (the
    check once zipped the old dout-first order with the new views, and no recipe was ever kept)."""
    from omnicupy.ops import backward

    got = backward._in_pointer_order(q="q", k="k", v="v", out="o", dout="dout", lse="lse")
    assert got == backward.POINTER_FIELDS[:6]


@pytest.mark.parametrize("family", ["wgmma", "sync"])
def test_deterministic_main_kernel_gets_the_shared_memory_opt_in(monkeypatch, family):
    """Each family's fixed-point main is an entry point of its own: it needs the same dynamic shared
    memory opt-in as the main kernel (a launch without it fails); the K/V bounds kernel beside it."""
    import cupy

    from omnicupy import jit
    from omnicupy.ops import backward

    class FakeKernel:
        def __init__(self, name):
            self.name, self.max_dynamic_shared_size_bytes = name, 0

        def sibling(self, name):
            return FakeKernel(name)

    variant = next(v for v in tiles.shipped_backward_variants(families=(family,)) if v.smem_bytes > 48 * 1024)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(jit, "get_kernel", lambda v: FakeKernel(v.name))
    monkeypatch.setattr(backward, "_modules", {})
    pre, atomic, fixed, convert, bounds = backward._kernels(variant)
    assert (pre.name, atomic.name, convert.name) == (f"{variant.name}_pre", variant.name, f"{variant.name}_dq")
    assert fixed.name == f"{variant.name}_det" and fixed.max_dynamic_shared_size_bytes == variant.smem_bytes
    assert bounds.name == f"{variant.name}_kvb"


# ---------------------------------------------------------------- deterministic dQ: how it is summed
@pytest.mark.parametrize("family,deterministic,unbounded_grad,expected", [
    ("wgmma", False, False, "ATOMIC"), ("sync", False, False, "ATOMIC"), ("sync", False, True, "ATOMIC"),
    ("wgmma", True, False, "FIXED"), ("sync", True, False, "FIXED"), ("sync", True, True, "ORDERED")])
def test_dq_sum_follows_family_and_mode(family, deterministic, unbounded_grad, expected):
    """Fixed point wherever its row bound holds; fp32 in order (mma.sync only: make_plan asks for that
    family) where a score derivative may exceed 1."""
    from omnicupy.ops.backward import DqSum
    assert DqSum.of(family, deterministic, unbounded_grad) is DqSum[expected]


def test_an_ordered_dq_sum_needs_the_sync_family():
    """Only the mma.sync kernel has turn counters: asking wgmma for an ordered sum is a dispatch bug,
    never a fixed-point sum whose row bound does not hold."""
    from omnicupy.ops.backward import DqSum
    with pytest.raises(ValueError, match="mma.sync"):
        DqSum.of("wgmma", True, unbounded_grad=True)


@pytest.mark.parametrize("dq_sum", ["ATOMIC", "ORDERED", "FIXED"])
def test_workspace_parts_follow_the_dq_sum(dq_sum):
    """Each mode's workspace holds exactly its parts, each 256-byte aligned and disjoint; the zeroed
    parts are the turn counters (ORDERED) and the K/V bounds (FIXED)."""
    from omnicupy.ops.backward import POINTER_FIELDS, DqSum, Workspace, WORKSPACE_ALIGN
    B, H, Hkv, D, pad, tile, passes = 2, 6, 3, 128, 320, 64, 1
    ws = Workspace.of(B, H, Hkv, D, pad, tile, passes, DqSum[dq_sum])
    parts = dict(zip(POINTER_FIELDS[POINTER_FIELDS.index("lse_log2"):], ws.sizes))
    rows = B * H * pad * 4
    assert parts["lse_log2"] == parts["delta"] == rows and parts["dq_accum"] == rows * D
    assert parts["dq_semaphore"] == (B * H * (pad // tile) * passes * 4 if dq_sum == "ORDERED" else 0)
    assert parts["dq_unit"] == (rows if dq_sum == "FIXED" else 0)
    assert parts["kv_bound"] == (B * Hkv * 2 * 4 if dq_sum == "FIXED" else 0)
    spans = sorted((off, off + size) for off, size in zip(ws.offsets, ws.sizes) if size)
    assert all(off % WORKSPACE_ALIGN == 0 for off, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])) and ws.total >= spans[-1][1]
    zeroed = {POINTER_FIELDS[POINTER_FIELDS.index("lse_log2") + i] for i in Workspace.ZEROED}
    assert zeroed == {"dq_semaphore", "kv_bound"}


@pytest.mark.parametrize("score_mod,deterministic,family", [
    (None, True, "wgmma"), (score_mods.softcap(5.0), True, "wgmma"), (score_mods.alibi(4), True, "wgmma"),
    (score_mods.cuda_score("score * S", {"S": 2.0}, grad="S"), True, "sync"),
    (score_mods.cuda_score("score * S", {"S": 2.0}, grad="S"), False, "wgmma")])
def test_deterministic_fixed_point_needs_a_bounded_score_derivative(score_mod, deterministic, family):
    """The wgmma kernels' fixed-point dQ bounds each row assuming |d score_mod / d score| <= 1 (the
    built-ins'); a deterministic call with any other derivative runs the mma.sync kernel's ordered sum."""
    rng = np.random.default_rng(3)
    _, q, k, v, _, _ = _inputs(rng, B=1, Hq=4, Hkv=4, Nq=256, Nkv=256, D=128)
    plan = omnicupy.ops.backward.plan(q, k, v, causal=True, score_mod=score_mod, deterministic=deterministic,
                                      arch="sm_90")
    assert plan.variant.family == family


@pytest.mark.parametrize("head_dim,rows", [(8, 256), (16, 128), (32, 64), (64, 32), (80, 16), (96, 16), (128, 16),
                                           (256, 8)])
def test_row_kernels_cover_rows_as_the_kernel_does(head_dim, rows):
    # kernels/bwd_rows.cuh RowShape (the templates static_assert it): one lane per 16-byte chunk,
    # rounded up to a power of two lanes per row, 32 / lanes rows per warp, 8 warps per CTA; the
    # host's grid must cover the same rows.
    from omnicupy.dispatch.variant import row_kernel_rows

    assert row_kernel_rows(head_dim) == rows
