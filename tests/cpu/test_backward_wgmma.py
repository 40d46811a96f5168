"""The wgmma backward family on the CPU: when it is selected, what it refuses, and that NVRTC builds
every variant it can run (shipped and with per-score features) for sm_90a with no register spills
and no ptxas-injected warpgroup waits. Correctness needs a GPU: tests/gpu/test_backward_wgmma_gpu.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

import omnicupy
from omnicupy import score_mods
from omnicupy.dispatch import tiles
from omnicupy.dispatch.variant import Variant
from omnicupy.errors import ArgumentError, VariantError
from omnicupy.jit import compiler, env, render

# (OMNICUPY_BWD, OMNICUPY_MMA, arch, head_dim, q_block, kv_block) -> family
SELECTION = [
    pytest.param("auto", "auto", "sm_90", 128, 128, 128, "wgmma", id="auto-hd128-wgmma"),
    pytest.param("auto", "auto", "sm_90", 128, 128, 64, "wgmma", id="auto-hd128-kv64-plain-wgmma"),
    pytest.param("auto", "auto", "sm_90", 64, 128, 128, "wgmma", id="auto-hd64-wgmma"),
    pytest.param("auto", "auto", "sm_90", 40, 128, 128, "sync", id="auto-padded-hd40-sync"),
    pytest.param("auto", "auto", "sm_80", 128, 128, 128, "sync", id="auto-ampere-sync"),
    pytest.param("auto", "sync", "sm_90", 128, 128, 128, "sync", id="auto-under-mma-sync"),
    pytest.param("sync", "auto", "sm_90", 64, 128, 128, "sync", id="sync"),
    pytest.param("wgmma", "auto", "sm_90", 64, 128, 128, "wgmma", id="wgmma-hd64"),
    pytest.param("wgmma", "sync", "sm_90", 128, 64, 64, "wgmma", id="wgmma-beats-mma-sync"),
    pytest.param("wgmma", "auto", "sm_80", 128, 128, 128, "sync", id="wgmma-needs-sm90"),
    pytest.param("wgmma", "auto", "sm_90", 256, 128, 128, "sync", id="hd256-stays-sync"),
    pytest.param("wgmma", "auto", "sm_90", 32, 128, 128, "sync", id="hd32-stays-sync"),
    pytest.param("wgmma", "auto", "sm_90", 128, 48, 96, "sync", id="blocks-not-64-multiples"),
    pytest.param("wgmma", "auto", "sm_90", 64, 128, 32, "sync", id="kv-block-32"),
]


@pytest.mark.parametrize("bwd,mma,arch,head_dim,qbs,kbs,family", SELECTION)
def test_family_selection(monkeypatch, bwd, mma, arch, head_dim, qbs, kbs, family):
    monkeypatch.setenv("OMNICUPY_BWD", bwd)
    monkeypatch.setenv("OMNICUPY_MMA", mma)
    v = tiles.select_backward_variant(head_dim, "fp16", qbs, kbs, True, True, arch=arch)
    assert v.family == family and v.operation == "backward"
    assert qbs % v.br == 0 and kbs % v.bc == 0 and v.runs_on(arch)


def test_auto_takes_the_table_entry(monkeypatch):
    """OMNICUPY_BWD=auto follows WGMMA_BWD_AUTO_HEAD_DIMS on sm_90 (and OMNICUPY_MMA=sync overrides it)."""
    monkeypatch.setattr(tiles, "WGMMA_BWD_AUTO_HEAD_DIMS", frozenset({128}))
    monkeypatch.delenv("OMNICUPY_BWD", raising=False)
    assert tiles.select_backward_variant(128, "bf16", 128, 128, False, False, arch="sm_90").family == "wgmma"
    assert tiles.select_backward_variant(64, "bf16", 128, 128, False, False, arch="sm_90").family == "sync"
    assert tiles.select_backward_variant(128, "bf16", 128, 128, False, False, arch="sm_80").family == "sync"
    monkeypatch.setenv("OMNICUPY_MMA", "sync")
    assert tiles.select_backward_variant(128, "bf16", 128, 128, False, False, arch="sm_90").family == "sync"


def test_bad_switch_is_a_named_error(monkeypatch):
    monkeypatch.setenv("OMNICUPY_BWD", "tensor")
    with pytest.raises(ArgumentError, match="OMNICUPY_BWD"):
        tiles.select_backward_variant(64, "fp16", 128, 128, False, False, arch="sm_90")
    assert "OMNICUPY_BWD" in env.VARIABLES


def test_plan_says_which_family_and_why(monkeypatch):
    q = np.zeros((2, 4, 333, 128), np.float16)
    k = np.zeros((2, 2, 333, 128), np.float16)
    monkeypatch.setenv("OMNICUPY_BWD", "wgmma")
    plan = omnicupy.ops.backward.plan(q, k, k, causal=True, arch="sm_90")
    assert plan.variant.family == "wgmma" and "OMNICUPY_BWD=wgmma" in plan.reason
    assert plan.grid == (-(-333 // plan.variant.bc), 2, 2) and plan.block == (plan.variant.threads, 1, 1)
    assert plan.smem_bytes == plan.variant.smem_bytes <= 227 * 1024
    fallback = omnicupy.ops.backward.plan(q[..., :32].copy(), k[..., :32].copy(), k[..., :32].copy(), arch="sm_90")
    assert fallback.variant.family == "sync" and "no wgmma backward tile" in fallback.reason


# (head_dim, q_block, kv_block) -> warp-specialized (kernels/bwd_ws.cuh) or plain (bwd_wgmma.cuh),
# threads, shared memory (kernels/bwd_wgmma.cuh Smem; each template static_asserts the same number)
WARP_SPECIALIZED = [
    # incl. three 32-byte q-tile records; every wgmma tile also 2 stages x 64 rows x 4 bytes of fixed-point units
    pytest.param(128, 128, 128, True, 384, 204960 + 512, id="hd128-ws"),
    pytest.param(128, 256, 512, True, 384, 204960 + 512, id="hd128-large-blocks-ws"),
    pytest.param(128, 64, 64, False, 128, 110592 + 512, id="hd128-kv64-plain"),
    pytest.param(64, 128, 128, False, 128, 61440 + 512, id="hd64-plain"),
]


@pytest.mark.parametrize("head_dim,qbs,kbs,ws,threads,smem", WARP_SPECIALIZED)
def test_warp_specialized_where_the_table_says(monkeypatch, head_dim, qbs, kbs, ws, threads, smem):
    monkeypatch.setenv("OMNICUPY_BWD", "wgmma")
    v = tiles.select_backward_variant(head_dim, "fp16", qbs, kbs, True, True, arch="sm_90")
    assert v.family == "wgmma" and v.warp_specialized == ws and kbs % v.bc == 0
    assert (v.threads, v.smem_bytes) == (threads, smem)


# per-score extras at D = 128 -> warp-specialized (score modifiers) or the plain kernel (a bias)
EXTRAS = [
    pytest.param({}, True, id="none-ws"),
    pytest.param(dict(score_expr=("softcap",), score_grad="1.0f"), True, id="score-mod-ws"),
    pytest.param(dict(bias="fp16"), False, id="bias-plain"),
    pytest.param(dict(bias="fp32", score_expr=("softcap",), score_grad="1.0f"), False, id="bias-and-score-plain"),
]


@pytest.mark.parametrize("extras,ws", EXTRAS)
def test_bias_keeps_the_plain_kernel(monkeypatch, extras, ws):
    monkeypatch.setenv("OMNICUPY_BWD", "wgmma")
    v = tiles.select_backward_variant(128, "fp16", 128, 128, True, False, arch="sm_90", **extras)
    assert v.family == "wgmma" and v.warp_specialized == ws


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(head_dim=128, br=64, bc=64, warps=8), id="ws-hd128-bc64"),
    pytest.param(dict(head_dim=256, br=64, bc=64, warps=4), id="hd256"),
    pytest.param(dict(head_dim=64, br=128, bc=64, warps=4), id="br128"),
    pytest.param(dict(head_dim=64, br=64, bc=64, warps=8), id="warps-not-per-64-kv-rows-or-ws-one-warpgroup"),
    pytest.param(dict(head_dim=64, br=64, bc=128, warps=8), id="hd64-two-warpgroups-split-dq-below-64"),
    pytest.param(dict(head_dim=128, br=64, bc=32, warps=2), id="bc32"),
    pytest.param(dict(head_dim=128, br=64, bc=64, warps=4, stages=1), id="one-stage"),
])
def test_invalid_wgmma_backward_variants(kwargs):
    kwargs = {"dtype": "fp16", "stages": 2, **kwargs}
    with pytest.raises(VariantError):
        Variant(operation="backward", family="wgmma", **kwargs)


def test_shipped_backward_variants_cover_wgmma():
    wgmma = tiles.shipped_backward_variants(families=("wgmma",))
    assert {(v.head_dim, v.dtype, v.causal, v.partial) for v in wgmma} == {
        (hd, dt, c, p) for hd in tiles.WGMMA_BACKWARD_TILES for dt in ("fp16", "bf16") for c in (0, 1) for p in (0, 1)}
    assert all(v.name.split("_st2_")[1].startswith("wgmma") and not v.runs_on("sm_80") for v in wgmma)
    from omnicupy.cli import catalogue

    assert set(wgmma) <= set(catalogue.shipped_variants(ops=("backward",)))


# ---------------------------------------------------------------- NVRTC, sm_90a
SOFTCAP = score_mods.softcap(5.0)
ALIBI = score_mods.alibi(4)
DOC_MASK = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": np.zeros(8, np.int32)})


def feature_variant(hd: int, dt: str, causal: bool, partial: bool, **extras) -> Variant:
    """The variant a call with these extras gets on sm_90 (128 x 128 blocks)."""
    return tiles.select_backward_variant(hd, dt, 128, 128, causal, partial, arch="sm_90", family="wgmma", **extras)


FEATURES = [
    *[feature_variant(hd, dt, True, True, bias="fp32", score_expr=SOFTCAP.cuda.key, score_grad=SOFTCAP.cuda_grad.text)
      for hd in tiles.WGMMA_BACKWARD_TILES for dt in ("fp16", "bf16")],
    *[feature_variant(hd, "fp16", causal, partial, bias=bias)
      for hd in tiles.WGMMA_BACKWARD_TILES for causal, partial in ((False, False), (True, False), (False, True))
      for bias in ("fp16", "fp32")],
    *[feature_variant(hd, "bf16", True, True, mask_expr=DOC_MASK.cuda.key, score_expr=ALIBI.cuda.key,
                      score_grad=score_mods.UNIT_GRAD) for hd in tiles.WGMMA_BACKWARD_TILES],
    *[feature_variant(hd, "fp16", False, True, mask_expr=DOC_MASK.cuda.key) for hd in tiles.WGMMA_BACKWARD_TILES],
    # two consumer warpgroups without a producer, and the plain kernel at D = 128 (not in the table: for measurements)
    *[tiles.backward_variant(tile, 128, "fp16", c, p, family="wgmma")
      for tile in (tiles.BwdTile(64, 128, 8), tiles.WGMMA_BACKWARD_FALLBACK) for c, p in ((False, False), (True, True))],
]
BUILDS = tiles.shipped_backward_variants(families=("wgmma",)) + FEATURES


def main_kernel_report(log: str, name: str) -> tuple[int, int]:
    """(registers, spill bytes) of entry function ``name`` (not its siblings) from ptxas -v."""
    block = re.search(rf"Compiling entry function '{name}' for.*?Used (\d+) registers", log, re.S)
    spill = re.search(rf"Function properties for {name}\n.*?(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert block and spill, log
    return int(block.group(1)), int(spill.group(1)) + int(spill.group(2))


#: Spill bytes allowed where the dQ staging of the bulk reductions (lab/notes/backward.md#s21) left ptxas a few
#: registers short at D = 128's 255: deterministic entries and unshipped feature variants (measured:
#: 8 bytes for the shipped causal+partial deterministic kernels). Every other shipped atomic kernel,
#: the default, must stay at 0, but for the D = 64 PARTIAL variants: at three CTAs per SM (168
#: registers) they spill 36-44 bytes and measured 13-17 % faster than at two without spills
#: (lab/notes/backward.md#s28).
SMALL_SPILLS = 64


#: The warp-specialized kernel (kernels/bwd_ws.cuh) splits 64512 registers between its producer and
#: its consumers, and no split leaves both spill-free: 20-92 bytes stored at the shipped atomic
#: kernels and up to 168 stored + 140 loaded at the PARTIAL deterministic one, which measured
#: 1.3x faster than the plain kernel's deterministic mode all the same (lab/notes/backward.md#s31). Calls with a
#: bias or score modifier keep the plain kernel (tiles.WGMMA_BACKWARD_FALLBACK).
WS_SPILLS = 320


def spills_allowed(variant, entry: str) -> int:
    if variant.warp_specialized:
        return WS_SPILLS
    shipped = variant in tiles.shipped_backward_variants(families=("wgmma",))
    if shipped and entry == variant.name and not (variant.head_dim == 64 and variant.partial):
        return 0
    return SMALL_SPILLS


@pytest.mark.parametrize("variant", BUILDS, ids=lambda v: v.name)
def test_wgmma_backward_compiles_without_spills(variant):
    source = render.render_source(variant)
    result = compiler.compile_cubin(source, name=variant.name, arch=variant.target_arch("sm_90"),
                                    include_dirs=[env.kernels_dir()])
    shipped = variant in tiles.shipped_backward_variants(families=("wgmma",))
    for entry in (variant.name, f"{variant.name}_det"):  # the atomic and the deterministic main kernel
        registers, spills = main_kernel_report(result.log, entry)
        allowed = spills_allowed(variant, entry)
        assert registers <= 255 and spills <= allowed, f"{entry}: {registers} registers, {spills} bytes spilled"
    # C7519/C7520: ptxas serializing wgmma around register use it could not prove safe.
    injected = [line for line in result.log.splitlines() if re.search(r"C75\d\d", line)]
    if shipped:
        assert not injected, injected
    for suffix in ("_pre", "", "_det", "_dq"):
        assert f" {variant.name}{suffix}(const __grid_constant__ BwdParams params)" in source
