"""The tma family without a GPU: NVRTC builds of every shipped variant for sm_90a (no spills, no
ptxas performance notes such as C7508 "setmaxnreg ignored" or C7512 "wgmma serialized"), the
tensor-map layouts TMA can and cannot express, the launch's tensor-map fields, and the fallback
to the wgmma family when tensor maps cannot be made."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import omnicupy
from omnicupy.dispatch import tiles
from omnicupy.dispatch.params import FORWARD_TMA
from omnicupy.dispatch.variant import Variant
from omnicupy.jit import compiler, env, launch, render
from omnicupy.ops import forward, recall, tma

SHIPPED = tiles.shipped_variants(families=("tma",))
#: Kernels a call can get besides the tuned ones: the other pipelines, the one-consumer fallback
#: and per-score work (which runs the plain pipeline).
OTHERS = [Variant(hd, "fp16", t.br, t.bc, t.warps, 2, True, True, family="tma", overlap=True, pingpong=pp)
          for (hd, _), t in tiles.TMA_TUNED.items() for pp in (False, True)] + \
         [Variant(hd, "fp16", 64, 64, 8, 2, True, True, family="tma", overlap=True) for hd in (64, 128, 256)] + \
         [Variant(hd, "bf16", t.br, t.bc, t.warps, 2, True, True, bias="fp32", family="tma")
          for (hd, _), t in tiles.TMA_TUNED.items()]


@pytest.fixture(scope="module")
def ptxas_logs():
    """{variant name: (registers, spill bytes, ptxas log)} for every variant, two NVRTC builds at a time."""
    def build(v):
        r = compiler.compile_cubin(render.render_source(v), name=v.name, arch="sm_90a",
                                   include_dirs=[env.kernels_dir()])
        return v.name, (r.registers, r.spill_bytes, r.log)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, SHIPPED + OTHERS))


def test_every_family_feature_is_shipped():
    assert {(v.head_dim, v.dtype, v.causal, v.partial) for v in SHIPPED} == {
        (hd, dt, c, p) for hd in (64, 128, 256) for dt in ("fp16", "bf16") for c in (False, True) for p in (False, True)}
    assert all(v.family == "tma" and v.target_arch("sm_90") == "sm_90a" for v in SHIPPED)


@pytest.mark.parametrize("variant", SHIPPED + OTHERS, ids=lambda v: v.name)
def test_builds_without_spills_or_ptxas_notes(variant, ptxas_logs):
    registers, spills, log = ptxas_logs[variant.name]
    assert spills == 0, log
    # C75xx: "Potential Performance Loss" notes, among them C7508 (setmaxnreg ignored) and C7512
    # (wgmma serialized for lack of registers).
    assert not re.search(r"C75\d\d", log), log
    # 384 threads: the launch bounds' 168 registers at entry, which setmaxnreg redistributes
    assert registers == (168 if variant.br == 128 else registers) and registers <= 255


@pytest.mark.parametrize("hd, br, bc, persistent, swizzled", [
    pytest.param(128, 192, 128, True, True, id="d128-192-rows-swizzled-staging"),
    pytest.param(128, 128, 128, True, False, id="d128-tuned-padded-staging"),
    pytest.param(64, 192, 128, True, False, id="d64-192-rows-padded-staging"),
    pytest.param(256, 128, 64, False, False, id="d256-one-cta-per-tile"),
])
def test_staging_rows_beside_the_tiles(hd, br, bc, persistent, swizzled):
    """Persistent CTAs stage O in rows of their own: padded where they fit, else unpadded in the
    XOR swizzle (the 192-row tile at D = 128: 1104 bytes over with padding); the template gets the
    same answer as the host's shared-memory count."""
    from omnicupy.dispatch.arch import smem_limit

    v = Variant(hd, "fp16", br, bc, br // 16 + 4, 2, True, family="tma")
    assert (v.persistent, v.staging_swizzled) == (persistent, swizzled)
    assert v.smem_bytes <= smem_limit("sm_90")
    assert f"kSwizzledStaging = {int(swizzled)} }};" in render.render_source(v)


def test_register_reallocation_is_in_the_code():
    source = render.render_source(SHIPPED[0])
    assert "setmaxnreg.dec" in (env.kernels_dir() / "tma.cuh").read_text()
    kernel = (env.kernels_dir() / "fwd_tma.cuh").read_text()  # the main loop's header (issue 35)
    assert "kReallocate = kConsumers >= 2" in kernel and "__launch_bounds__(kThreads, 1)" in source


# ---------------------------------------------------------------- layouts
def _array(shape, strides_elems, itemsize=2):
    """A stand-in with the attributes TensorLayout reads (NumPy cannot make every stride we test)."""
    class A:
        pass
    a = A()
    a.shape = shape
    a.strides = tuple(s * itemsize for s in strides_elems)
    return a


@pytest.mark.parametrize("strides,problem", [
    pytest.param((4 * 100 * 64, 100 * 64, 64, 1), None, id="contiguous"),
    pytest.param((100 * 4 * 64, 64, 4 * 64, 1), None, id="bnhd-view"),
    pytest.param((4 * 100 * 64, 100 * 64, -64, 1), "sequence stride", id="reversed"),
    pytest.param((4 * 100 * 64, 0, 64, 1), "head stride", id="broadcast-heads"),
    pytest.param((4 * 100 * 72, 100 * 72, 68, 1), "sequence stride of 136", id="rows-not-16-byte"),
])
def test_layout_problems(strides, problem):
    layout = tma.TensorLayout.of(_array((2, 4, 100, 64), strides), "fp16")
    found = layout.problem()
    assert (found is None) if problem is None else (problem in found)


def test_extent_one_dimensions_get_dense_stand_in_strides():
    # B = 1 and H = 1 with arbitrary strides: never stepped over, so valid dense strides are encoded
    layout = tma.TensorLayout.of(_array((1, 1, 100, 64), (7, 3, 64, 1)), "bf16")
    assert layout.problem() is None
    assert layout.dims == (64, 100, 1, 1)
    assert layout.encoding_strides() == (128, 100 * 128, 100 * 128)


# ---------------------------------------------------------------- launch fields
def test_map_writer_fills_each_map_at_its_offset(monkeypatch):
    calls = []

    def fake_encode(ptr, layout, box):
        calls.append((ptr, box))
        return bytes([len(calls)]) * 128

    monkeypatch.setattr(tma, "encode", fake_encode)
    v = Variant(128, "fp16", 128, 128, 12, 2, family="tma")
    q = np.zeros((1, 2, 300, 128), np.float16)
    writer = tma.MapWriter.make(v, q, q, q, "fp16")
    buf = bytearray(FORWARD_TMA.size)
    writer(buf, (0x1000, 0x2000, 0x3000, 0x4000, 0))
    assert calls == [(0x1000, 128), (0x2000, 128), (0x3000, 128)]
    for i, name in enumerate(("q_map", "k_map", "v_map")):
        off = FORWARD_TMA.offset(name)
        assert off % 64 == 0 and buf[off:off + 128] == bytes([i + 1]) * 128
    writer(buf, (0x1000, 0x2000, 0x3000, 0x5000, 0))  # same q, k, v: the writer's own copy, no encode
    assert len(calls) == 3
    writer(buf, (0x1000, 0x2000, 0x7000, 0x5000, 0))  # a new v: that triple is encoded
    assert calls[3:] == [(0x1000, 128), (0x2000, 128), (0x7000, 128)]
    assert buf[FORWARD_TMA.offset("v_map"):FORWARD_TMA.offset("v_map") + 128] == bytes([6]) * 128


def test_map_writer_keeps_a_bounded_number_of_pointer_triples(monkeypatch):
    monkeypatch.setattr(tma, "encode", lambda ptr, layout, box: bytes(128))
    q = np.zeros((1, 2, 300, 128), np.float16)
    writer = tma.MapWriter.make(Variant(128, "fp16", 128, 128, 12, 2, family="tma"), q, q, q, "fp16")
    buf = bytearray(FORWARD_TMA.size)
    for i in range(3 * tma.WRITER_CACHE_SIZE):
        writer(buf, (16 * i, 16 * i + 16, 16 * i + 32))
        assert len(writer._blobs) <= tma.WRITER_CACHE_SIZE


def test_encode_is_cached_per_pointer_and_layout():
    assert tma.encode.cache_info().maxsize == tma.CACHE_SIZE  # functools.lru_cache


# ---------------------------------------------------------------- fallback
def test_no_tensor_maps_means_the_wgmma_family_where_the_call_runs(monkeypatch):
    """Without tensor maps here, a call here runs the wgmma family; a plan for a named arch
    describes the target, whose driver and cuda-bindings it assumes (and says so)."""
    from omnicupy.ops import forward

    monkeypatch.setenv("OMNICUPY_MMA", "tma")
    monkeypatch.setattr(tma, "available", lambda: False)
    x = np.zeros((1, 2, 300, 128), np.float16)
    inp, bm, extras = forward._check_call(x, x, x, None, True, None, None, None, False)
    assert forward.make_plan(inp, bm, None, extras, "sm_90").variant.family == "wgmma"
    plan = omnicupy.plan(x, x, x, causal=True, arch="sm_90")
    assert plan.variant.family == "tma" and "cuda-bindings" in plan.reason


def test_tensor_maps_available_means_the_tma_family(monkeypatch):
    monkeypatch.setenv("OMNICUPY_MMA", "tma")
    monkeypatch.setattr(tma, "available", lambda: True)
    x = np.zeros((1, 2, 300, 128), np.float16)
    plan = omnicupy.plan(x, x, x, causal=True, arch="sm_90")
    assert plan.variant.family == "tma" and "tma" in plan.reason
    assert plan.block == (384, 1, 1) and plan.smem_bytes == plan.variant.smem_bytes


def test_recipe_writes_the_maps_of_each_calls_pointers(monkeypatch):
    seen = []

    class FakeKernel:  # the CuPy-function route: called with the struct as one record
        name, function_ptr = "fake", 0

        def __call__(self, grid, block, args, **kwargs):
            seen.append(bytes(args[0]))

    monkeypatch.setattr(launch, "_ROUTE", [None])
    monkeypatch.setattr(launch, "_ROUTE_NAME", [None])
    launch.use_route("function")
    plan = type("P", (), {"grid": (1, 1, 1), "block": (384, 1, 1), "smem_bytes": 0})()
    recipe = recall.Recipe(
        plan=plan, launcher=launch.Launcher(bytes(FORWARD_TMA.size), [launch.KernelLaunch(FakeKernel(), (1, 1, 1),
                                                                                          (384, 1, 1))]),
        slots=recall.PointerSlots(FORWARD_TMA.offset(n) for n in ("q", "k", "v", "o", "lse")), keep=(),
        params=FORWARD_TMA,
        maps=lambda buf, ptrs: buf.__setitem__(slice(FORWARD_TMA.offset("q_map"), FORWARD_TMA.offset("q_map") + 8),
                                               ptrs[0].to_bytes(8, "little")))
    recipe.launch(0xABC0, 0x10, 0x20, 0x30, 0)
    packed = FORWARD_TMA.unpack(seen[0])
    assert packed["q"] == 0xABC0 and packed["q_map"][:8] == (0xABC0).to_bytes(8, "little")
