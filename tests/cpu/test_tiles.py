"""Variant selection: which kernel family and tile a call gets (no GPU needed)."""
from __future__ import annotations

import pytest

from omnicupy.dispatch import tiles
from omnicupy.errors import ArgumentError
from omnicupy.dispatch.variant import Variant

# (head_dim, stages, q_block, kv_block, arch, OMNICUPY_MMA) -> expected family
SELECTION = [
    (64, None, 128, 128, "sm_90", "auto", "tma"),         # D = 64 with CAUSAL blocks (lab/notes/forward.md#s24)
    (128, 2, 128, 128, "sm_90", "auto", "tma"),         # tma measured faster at D = 128 (lab/notes/forward.md#s12)
    (256, None, 128, 128, "sm_90", "auto", "tma"),
    (128, None, 128, 128, "sm_80", "auto", "sync"),     # wgmma is Hopper-only
    (128, None, 128, 128, "sm_100", "auto", "sync"),    # sm_90a code does not run on later archs
    (128, None, 128, 128, None, "auto", "sync"),        # arch unknown: the portable family
    (128, 1, 128, 128, "sm_90", "auto", "sync"),        # no single-buffer wgmma kernel
    (96, None, 128, 128, "sm_90", "auto", "sync"),      # the swizzle needs 64-column blocks
    (32, None, 128, 128, "sm_90", "auto", "sync"),
    (128, None, 32, 128, "sm_90", "auto", "sync"),      # q blocks below one warpgroup's 64 rows
    (128, None, 64, 64, "sm_90", "auto", "wgmma"),      # the 64x64 fallback tile
    (64, None, 128, 64, "sm_90", "auto", "wgmma"),      # 64-wide kv blocks: the 64x64 fallback
    (128, None, 128, 128, "sm_90", "sync", "sync"),
    # the tma family: opt-in (OMNICUPY_MMA=tma) where it has not measured faster than wgmma
    (64, None, 128, 128, "sm_90", "tma", "tma"),
    (128, 2, 128, 128, "sm_90", "tma", "tma"),
    (256, None, 128, 128, "sm_90", "tma", "tma"),
    (128, None, 64, 64, "sm_90", "tma", "tma"),         # one consumer warpgroup: the 64x64 fallback
    (128, 1, 128, 128, "sm_90", "tma", "sync"),         # no single-buffer kernel in either Hopper family
    (96, None, 128, 128, "sm_90", "tma", "sync"),       # TMA boxes of 64 columns, as the swizzle
    (128, None, 128, 128, "sm_80", "tma", "sync"),      # Hopper-only
    (128, None, 32, 128, "sm_90", "tma", "sync"),
]


@pytest.mark.parametrize("hd,stages,qb,kvb,arch,env,family", SELECTION)
def test_family_selection(monkeypatch, hd, stages, qb, kvb, arch, env, family):
    monkeypatch.setenv("OMNICUPY_MMA", env)
    variant = tiles.select_variant(hd, "fp16", stages, qb, kvb, True, False, arch=arch)
    assert variant.family == family
    assert qb % variant.br == 0 and kvb % variant.bc == 0


def test_forced_wgmma_that_cannot_apply_is_an_argument_error(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "wgmma")
    with pytest.raises(ArgumentError, match="OMNICUPY_MMA=wgmma"):
        tiles.select_variant(96, "fp16", None, 128, 128, False, False, arch="sm_90")


def test_bad_mma_environment_value(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "tensor")
    with pytest.raises(ValueError, match="OMNICUPY_MMA"):
        tiles.select_variant(64, "fp16", None, 128, 128, False, False, arch="sm_90")


def test_per_score_work_drops_the_overlapped_pipeline(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "wgmma")
    assert tiles.WGMMA_TUNED[(256, 2)].overlap
    plain = tiles.select_variant(256, "fp16", None, 128, 128, False, False, arch="sm_90")
    biased = tiles.select_variant(256, "fp16", None, 128, 128, False, False, bias="fp32", arch="sm_90")
    assert plain.overlap and not biased.overlap and biased.family == "wgmma"


@pytest.mark.parametrize("kwargs,message", [
    (dict(head_dim=96, br=128, bc=64, warps=8), "head_dim"),
    (dict(head_dim=64, br=96, bc=64, warps=6), "multiple of 64"),
    (dict(head_dim=64, br=128, bc=64, warps=4), "one warp per 16 rows"),
    (dict(head_dim=64, br=128, bc=96, warps=8), "bc must be one of"),
])
def test_bad_wgmma_variant(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Variant(dtype="fp16", stages=2, family="wgmma", **kwargs)


def test_overlap_needs_wgmma():
    with pytest.raises(ValueError, match="overlap"):
        Variant(64, "fp16", 128, 64, 4, 2, overlap=True)


def test_wgmma_shared_memory_counts_both_buffers_and_alignment_slack():
    v = Variant(128, "fp16", 128, 128, 8, 2, family="wgmma")
    assert v.smem_bytes == 1024 + (128 + 2 * 2 * 128) * 128 * 2


@pytest.mark.parametrize("spec,tile", [
    ("128:64:8", tiles.Tile(128, 64, 8)),
    ("128:64:8:o", tiles.Tile(128, 64, 8, overlap=True)),
    ("64:128:4:p8", tiles.Tile(64, 128, 4, poly_exp=8)),
    ("128:64:8:o:p4", tiles.Tile(128, 64, 8, overlap=True, poly_exp=4)),
])
def test_tile_spec_parses(spec, tile):
    assert tiles.Tile.parse(spec) == tile


@pytest.mark.parametrize("spec", ["128:64", "128:64:8:x", "128:64:8:p", "a:64:8"])
def test_bad_tile_spec(spec):
    with pytest.raises(ValueError):
        tiles.Tile.parse(spec)


def test_tile_options_reach_the_variant(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "wgmma")
    with tiles.use_tiles({(128, 2): tiles.Tile(128, 128, 8, poly_exp=8)}, family="wgmma"):
        v = tiles.select_variant(128, "fp16", None, 128, 128, True, False, arch="sm_90")
    assert (v.br, v.bc, v.warps, v.poly_exp, v.family) == (128, 128, 8, 8, "wgmma") and "_pe8" in v.name


@pytest.mark.parametrize("poly_exp", [-1, 3, 16])
def test_poly_exp_must_divide_the_n8_tiles(poly_exp):
    with pytest.raises(ValueError, match="poly_exp"):
        Variant(64, "fp16", 64, 64, 4, 2, poly_exp=poly_exp)  # bc 64: 8 n8 tiles


@pytest.mark.parametrize("hd,causal,extras,want", [
    (128, False, {}, "tma"), (128, True, {"bias": "fp16"}, "tma"), (256, True, {}, "tma"),
    # D = 64: tma only with CAUSAL blocks and no per-score work or fused mask (TMA_AUTO_CAUSAL_HEAD_DIMS)
    (64, True, {}, "tma"), (64, False, {}, "wgmma"), (64, True, {"bias": "fp16"}, "wgmma"),
    (64, True, {"mask_expr": ("q_idx >= kv_idx", ())}, "wgmma"),
])
def test_tma_is_automatic_only_where_measured(monkeypatch, hd, causal, extras, want):
    monkeypatch.setenv("OMNICUPY_MMA", "auto")
    assert tiles.select_variant(hd, "fp16", None, 128, 128, causal, True, arch="sm_90", **extras).family == want
    monkeypatch.setattr(tiles, "TMA_AUTO_HEAD_DIMS", frozenset())
    monkeypatch.setattr(tiles, "TMA_AUTO_CAUSAL_HEAD_DIMS", frozenset())
    assert tiles.select_variant(hd, "fp16", None, 128, 128, causal, True, arch="sm_90", **extras).family == "wgmma"


@pytest.mark.parametrize("kwargs,message", [
    pytest.param(dict(head_dim=96, br=128, bc=64, warps=12), "head_dim", id="head-dim"),
    pytest.param(dict(head_dim=64, br=256, bc=64, warps=20), "br must be 64, 128 or 192", id="four-consumers"),
    pytest.param(dict(head_dim=64, br=128, bc=64, warps=8), "producer warps", id="no-producer"),
    pytest.param(dict(head_dim=64, br=128, bc=96, warps=12), "bc must be one of", id="bc"),
    pytest.param(dict(head_dim=64, br=128, bc=64, warps=12, stages=1), "stages 2", id="stages"),
    pytest.param(dict(head_dim=64, br=64, bc=64, warps=8, overlap=True, pingpong=True), "pingpong",
                 id="pingpong-one-consumer"),
    pytest.param(dict(head_dim=64, br=128, bc=64, warps=12, pingpong=True), "pingpong", id="pingpong-no-overlap"),
])
def test_bad_tma_variant(kwargs, message):
    kwargs.setdefault("stages", 2)
    with pytest.raises(ValueError, match=message):
        Variant(dtype="fp16", family="tma", **kwargs)


def test_tma_variant_name_smem_and_arch():
    v = Variant(128, "fp16", 128, 128, 12, 2, True, False, family="tma", overlap=True, pingpong=True)
    assert v.name == "omni_fwd_fp16_hd128_br128_bc128_w12_st2_tmaop_causal" and v.threads == 384
    # one swizzle atom of slack, Q, two stages of K and V, the mbarriers; persistent CTAs (the
    # staging rows fit beside them) add the epilogue's padded staging rows
    assert v.persistent and v.smem_bytes == 1024 + (128 + 2 * 2 * 128) * 128 * 2 + 128 + 128 * (128 + 8) * 2
    wide = Variant(256, "fp16", 128, 64, 12, 2, True, False, family="tma")
    assert not wide.persistent and wide.smem_bytes == 1024 + (128 + 2 * 2 * 64) * 256 * 2 + 128
    assert v.target_arch("sm_90") == "sm_90a" and v.runs_on("sm_90") and not v.runs_on("sm_80")
    with pytest.raises(ValueError, match="only sm_90"):
        v.target_arch("sm_80")
    assert "FwdTmaParams" in v.template_params()["params_struct"]
