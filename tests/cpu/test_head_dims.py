"""Padded head dims on the CPU: any D % 8 == 0 in 8..256 runs on the next tile head dim (kernel
names, tiles, families, plans), bad head dims raise HeadDimError before any launch, one padded
kernel of each kind compiles with NVRTC without spills, and the padding code vanishes from the
kernels whose head dim is a tile's. The GPU side is tests/gpu/test_head_dims_gpu.py."""
from __future__ import annotations

import argparse
import re
import shutil

import numpy as np
import pytest

from omnicupy import BlockMask
from omnicupy.cli.common import comma_list
from omnicupy.dispatch import tiles
from omnicupy.dispatch.plan import plan_backward, plan_forward
from omnicupy.dispatch.variant import (ACCEPTED_HEAD_DIMS, SUPPORTED_HEAD_DIMS, Variant, check_head_dim,
                                       tile_head_dim)
from omnicupy.errors import ArgumentError, HeadDimError, VariantError
from omnicupy.jit import env
from omnicupy.jit import compiler
from omnicupy.jit.render import render_source
from omnicupy.ops import decode
from omnicupy.ops.inputs import check_qkv

# ------------------------------------------------------------------------------ tile selection
#: D -> (mma.sync tile, tile of the wgmma/tma families or None where they would pad more than mma.sync)
TILES = [
    pytest.param(8, 32, None, id="8"),
    pytest.param(16, 32, None, id="16"),
    pytest.param(24, 32, None, id="24"),
    pytest.param(32, 32, None, id="32"),
    pytest.param(40, 64, 64, id="40"),
    pytest.param(48, 64, 64, id="48"),
    pytest.param(56, 64, 64, id="56"),
    pytest.param(64, 64, 64, id="64"),
    pytest.param(72, 96, None, id="72"),
    pytest.param(80, 96, None, id="80"),
    pytest.param(88, 96, None, id="88"),
    pytest.param(96, 96, None, id="96"),
    pytest.param(104, 128, 128, id="104"),
    pytest.param(112, 128, 128, id="112"),
    pytest.param(120, 128, 128, id="120"),
    pytest.param(128, 128, 128, id="128"),
    pytest.param(136, 256, 256, id="136"),
    pytest.param(160, 256, 256, id="160"),
    pytest.param(192, 256, 256, id="192"),
    pytest.param(248, 256, 256, id="248"),
    pytest.param(256, 256, 256, id="256"),
]


@pytest.mark.parametrize("hd,sync_tile,hopper_tile", TILES)
def test_tile_head_dims(hd, sync_tile, hopper_tile):
    assert tile_head_dim(hd) == sync_tile
    assert tiles.hopper_head_dim(hd) == hopper_tile


@pytest.mark.parametrize("hd,sync_tile,hopper_tile", TILES)
@pytest.mark.parametrize("env_family", ["auto", "sync", "wgmma", "tma"])
def test_forward_selection(monkeypatch, hd, sync_tile, hopper_tile, env_family):
    monkeypatch.setenv("OMNICUPY_MMA", env_family)
    if env_family == "wgmma" and hopper_tile is None:
        with pytest.raises(ArgumentError, match="OMNICUPY_MMA=wgmma"):
            tiles.select_variant(hd, "fp16", None, 128, 128, True, False, arch="sm_90")
        return
    v = tiles.select_variant(hd, "fp16", None, 128, 128, True, False, arch="sm_90")
    want_family = "sync" if env_family == "sync" or hopper_tile is None else (
        env_family if env_family != "auto" else ("tma" if tiles.auto_picks_tma(hopper_tile, True) else "wgmma"))
    assert v.family == want_family
    assert v.head_dim == (sync_tile if v.family == "sync" else hopper_tile)
    assert v.real_head_dim == hd and v.padded == (hd != v.head_dim)
    assert f"_hd{hd}p{v.head_dim}_" in v.name if v.padded else f"_hd{hd}_" in v.name
    # every other arch: mma.sync on the same tile
    monkeypatch.setenv("OMNICUPY_MMA", "auto")
    portable = tiles.select_variant(hd, "bf16", None, 128, 128, True, False, arch="sm_80")
    assert (portable.family, portable.head_dim, portable.real_head_dim) == ("sync", sync_tile, hd)


@pytest.mark.parametrize("hd,sync_tile,hopper_tile", TILES)
def test_backward_and_decode_selection(hd, sync_tile, hopper_tile):
    b = tiles.select_backward_variant(hd, "fp16", 128, 128, True, True, arch="sm_90", family="sync")
    assert (b.head_dim, b.real_head_dim, b.operation) == (sync_tile, hd, "backward")
    # the tile's table entry, whatever D is padded onto it
    assert (b.br, b.bc, b.warps) == tuple(getattr(tiles.BACKWARD_TILES[sync_tile], f) for f in ("br", "bc", "warps"))
    # the wgmma backward (the default on sm_90 at its head dims) takes no padded head dim
    auto = tiles.select_backward_variant(hd, "fp16", 128, 128, True, True, arch="sm_90")
    assert auto.family == ("wgmma" if hd in tiles.WGMMA_BWD_AUTO_HEAD_DIMS else "sync") and auto.real_head_dim == hd
    d = decode.decode_variant(hd, "fp16", 32, causal=False, partial=False, score_expr=None, arch="sm_90")
    c = decode.combine_variant(hd, "bf16")
    assert (d.head_dim, d.real_head_dim) == (sync_tile, hd) and (c.head_dim, c.real_head_dim) == (sync_tile, hd)


def test_names_distinguish_padded_from_tile_head_dims():
    names = {Variant(64, "fp16", 128, 128, 4, 2, head_dim_valid=d).name for d in (40, 48, 56, 64)}
    assert len(names) == 4
    assert Variant(64, "fp16", 128, 128, 4, 2, head_dim_valid=64) == Variant(64, "fp16", 128, 128, 4, 2)
    assert Variant(64, "fp16", 128, 128, 4, 2, head_dim_valid=64).name == "omni_fwd_fp16_hd64_br128_bc128_w4_st2"
    assert Variant(64, "fp16", 128, 128, 4, 2, head_dim_valid=40).name == "omni_fwd_fp16_hd40p64_br128_bc128_w4_st2"


@pytest.mark.parametrize("kwargs,message", [
    pytest.param(dict(head_dim=64, head_dim_valid=72), "exceeds", id="wider-than-tile"),
    pytest.param(dict(head_dim=64, head_dim_valid=44), "multiple of 8", id="not-multiple-of-8"),
    pytest.param(dict(head_dim=48), "not supported", id="tile-not-a-tile-head-dim"),
])
def test_bad_padded_variant(kwargs, message):
    with pytest.raises(VariantError, match=message):
        Variant(dtype="fp16", br=128, bc=64, warps=4, stages=2, **kwargs)


def test_plans_of_padded_head_dims():
    bm = BlockMask.causal(300, 300, q_block_size=128, kv_block_size=128)
    fwd = plan_forward(head_dim=40, dtype="fp16", batch=1, heads=2, block_mask=bm, stages=None, bias=None,
                       mask_expr=None, score_expr=None, arch="sm_80")
    assert "head dim 40 padded to the tile's 64" in fwd.describe()
    bwd = plan_backward(head_dim=192, dtype="bf16", batch=1, kv_heads=2, block_mask=bm, bias=None, mask_expr=None,
                        score_expr=None, score_grad=None, arch="sm_90")
    # two column passes of 128 over the 256-column tile: the second holds columns 128..191
    assert bwd.variant.head_dim == 256 and bwd.grid[0] == 2 * -(-300 // bwd.variant.bc)


def test_shipped_variants_stay_unpadded_and_padded_ones_are_on_request():
    assert not any(v.padded for v in tiles.shipped_variants() + tiles.shipped_backward_variants()
                   + decode.shipped_variants())
    asked = tiles.shipped_variants(head_dims=(40, 80))
    assert asked and all(v.padded for v in asked)
    assert {(v.real_head_dim, v.family) for v in asked} == {(40, "sync"), (40, "wgmma"), (40, "tma"), (80, "sync")}


# ------------------------------------------------------------------------------ bad head dims
BAD_HEAD_DIMS = [pytest.param(d, id=str(d)) for d in (4, 12, 20, 100, 250, 264, 512)]


@pytest.mark.parametrize("hd", BAD_HEAD_DIMS)
def test_bad_head_dim_is_refused_before_any_launch(hd):
    q = np.zeros((1, 2, 5, hd), np.float16)
    with pytest.raises(HeadDimError, match=f"head_dim {hd} is not supported"):
        check_qkv(q, q, q)
    with pytest.raises(HeadDimError):
        tiles.select_variant(hd, "fp16", None, 128, 128, False, False, arch="sm_90")
    with pytest.raises(HeadDimError):
        tiles.select_backward_variant(hd, "fp16", 128, 128, False, False)
    assert issubclass(HeadDimError, ArgumentError)


@pytest.mark.parametrize("hd", [pytest.param(d, id=str(d)) for d in (8, 40, 80, 136, 200, 256)])
def test_good_head_dims_pass_the_input_checks(hd):
    q = np.zeros((1, 2, 5, hd), np.float16)
    assert check_qkv(q, q, q).head_dim == hd


@pytest.mark.parametrize("value", [40.0, "40", True, None])
def test_head_dim_must_be_an_int(value):
    with pytest.raises(HeadDimError):
        check_head_dim(value)


def test_precompile_head_dims_option_takes_any_accepted_head_dim():
    parse = comma_list(int, ACCEPTED_HEAD_DIMS, "head dim")
    assert parse("40,80,192") == (40, 80, 192)
    for bad in ("12", "264", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert set(SUPPORTED_HEAD_DIMS) <= set(ACCEPTED_HEAD_DIMS) and len(ACCEPTED_HEAD_DIMS) == 32


# ------------------------------------------------------------------------------ compiles
def _spills(log: str) -> list[int]:
    """Spill bytes (stores + loads) of every kernel in a ptxas -v log."""
    return [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]


def _compile(variant: Variant, arch: str, kernels_dir=None):
    return compiler.compile_cubin(render_source(variant), name=variant.name, arch=arch,
                         include_dirs=[kernels_dir or env.kernels_dir()])


def _padded_kernels():
    fwd = lambda hd, family: tiles.select_variant(hd, "fp16", None, 128, 128, True, True, arch="sm_90", family=family)
    return [
        pytest.param(fwd(40, "sync"), "sm_80", id="fwd-sync-40"),
        pytest.param(fwd(80, "sync"), "sm_80", id="fwd-sync-80"),
        pytest.param(fwd(192, "wgmma"), "sm_90a", id="fwd-wgmma-192"),
        pytest.param(fwd(40, "tma"), "sm_90a", id="fwd-tma-40"),
        pytest.param(tiles.select_backward_variant(80, "bf16", 128, 128, True, True), "sm_80", id="bwd-80"),
        pytest.param(decode.decode_variant(40, "fp16", 32, causal=True, partial=True, score_expr=None, arch="sm_90"),
                     "sm_80", id="decode-40"),
        pytest.param(decode.combine_variant(192, "bf16"), "sm_80", id="combine-192"),
    ]


@pytest.mark.parametrize("variant,arch", _padded_kernels())
def test_padded_kernel_compiles_without_spills(variant, arch):
    assert variant.padded
    result = _compile(variant, arch)
    spills = _spills(result.log)
    assert spills and not any(spills), f"{variant.name}: ptxas spills {spills}"
    assert len(result.cubin) > 1000


@pytest.mark.parametrize("variant", [
    pytest.param(Variant(64, "fp16", 128, 128, 4, 2, True, True), id="fwd-sync-64"),
    pytest.param(tiles.backward_variant(tiles.BACKWARD_TILES[128], 128, "bf16", True, False), id="bwd-128"),
])
def test_unpadded_kernels_compile_to_the_same_code_without_the_padding_guard(variant, tmp_path):
    """The cheap form of the byte-for-byte check (lab/tools/hd_cubin_digest.py does every shipped
    kernel against the tree before the change): with real_chunk forced to a literal true, a kernel
    whose head dim is its tile's compiles to the same cubin, so the guard costs it nothing."""
    kernels = tmp_path / "kernels"
    shutil.copytree(env.kernels_dir(), kernels)
    ptx = (kernels / "ptx.cuh").read_text()
    guard = "return Cfg::kHeadDimValid == Cfg::kHeadDim || ch < Cfg::kHeadDimValid / 8;"
    assert guard in ptx
    (kernels / "ptx.cuh").write_text(ptx.replace(guard, "return true;"))
    assert _compile(variant, "sm_80").cubin == _compile(variant, "sm_80", kernels).cubin
