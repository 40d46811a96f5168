"""Render and NVRTC-compile every shipped variant for sm_80 and sm_90 (no GPU needed).

mma.sync variants build for both archs; wgmma and tma variants for sm_90 only, as sm_90a."""
from __future__ import annotations

import pytest

from omnicupy import jit
from omnicupy.dispatch import tiles
from omnicupy.errors import CompileError
from omnicupy.jit import compiler, render
from omnicupy.jit.cache import DiskCache
from omnicupy.dispatch.variant import HOPPER_FAMILIES, WGMMA_HEAD_DIMS, Variant

SHIPPED = tiles.shipped_variants()
ARCHS = ("sm_80", "sm_90")
BUILDS = [(v, arch) for v in SHIPPED for arch in ARCHS if v.family == "sync" or arch == "sm_90"]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("kernel-cache"))


@pytest.mark.parametrize("variant,arch", BUILDS, ids=lambda x: getattr(x, "name", x))
def test_shipped_variant_compiles(variant, arch, compile_cache):
    entry, built = jit.build(variant, arch, cache=compile_cache)
    assert built
    target = "sm_90a" if variant.family in HOPPER_FAMILIES else arch
    assert entry.size > 1000 and entry.meta["kernel"] == variant.name and entry.meta["arch"] == target
    assert entry.meta["registers"] is not None and entry.meta["registers"] <= 255
    if variant.family in HOPPER_FAMILIES:  # the wgmma and tma tiles were chosen spill-free (lab/notes/forward.md#s9, lab/notes/forward.md#s12)
        assert entry.meta["spill_bytes"] == 0
    # A second request is a verified cache hit, not a recompile.
    again, built_again = jit.build(variant, arch, cache=compile_cache)
    assert not built_again and again.binary_path == entry.binary_path


# Kernels a call can get besides the tuned ones: the fallback tiles (block sizes the tuned tile
# does not divide) and the variant options that no tuned tile uses yet.
OTHER_WGMMA = [Variant(hd, "fp16", t.br, t.bc, t.warps, 2, True, True, family="wgmma")
               for hd in WGMMA_HEAD_DIMS for t in tiles.WGMMA_FALLBACKS]
POLY_EXP = [Variant(64, "bf16", 64, 128, 4, 2, True, True, family="wgmma", poly_exp=8),
            Variant(128, "fp16", 128, 128, 8, 2, False, True, family="wgmma", poly_exp=4),
            Variant(128, "fp16", 128, 64, 4, 2, True, False, poly_exp=8)]


#: Fallback and option variants are not tuned: ptxas may spill a few words at the register limit
#: (the hd256 64x64 wgmma fallback and the mma.sync poly_exp option: 28-72 bytes, lab/notes/host-path.md#s11).
MAX_UNTUNED_SPILL_BYTES = 128


@pytest.mark.parametrize("variant", OTHER_WGMMA + POLY_EXP, ids=lambda v: v.name)
def test_fallback_and_option_variants_compile(variant, compile_cache):
    entry, _ = jit.build(variant, "sm_90", cache=compile_cache)
    assert entry.meta["kernel"] == variant.name and entry.meta["spill_bytes"] <= MAX_UNTUNED_SPILL_BYTES


def test_kernel_names_are_unique():
    assert len({v.name for v in SHIPPED}) == len(SHIPPED)
    for v in SHIPPED[:4]:
        assert f'extern "C" __global__ void __launch_bounds__(kThreads) {v.name}(' in render.render_source(v)


def test_template_is_strict():
    """A missing template parameter is an error, never an empty string in the kernel."""
    import jinja2

    template = render._environment().get_template(SHIPPED[0].template)
    params = SHIPPED[0].template_params()
    del params["bc"]
    with pytest.raises(jinja2.UndefinedError):
        template.render(**params)


def test_compile_error_carries_log_and_name():
    with pytest.raises(CompileError) as info:
        compiler.compile_cubin('extern "C" __global__ void broken() { undefined_thing(); }', name="broken_kernel",
                               arch="sm_80")
    text = str(info.value)
    assert "broken_kernel" in text and "undefined_thing" in text and "-arch=sm_80" in text


@pytest.mark.parametrize("arch,expected", [("sm_90", "sm_90"), ("90", "sm_90"), (80, "sm_80"), ("sm_90a", "sm_90a")])
def test_normalize_arch(arch, expected):
    assert compiler.normalize_arch(arch) == expected


def test_bad_arch_is_rejected():
    with pytest.raises(ValueError, match="sm_80"):
        compiler.normalize_arch("hopper")


def test_wgmma_variants_are_shipped_for_their_head_dims():
    wgmma = [v for v in SHIPPED if v.family == "wgmma"]
    assert {v.head_dim for v in wgmma} == {hd for hd, _ in tiles.WGMMA_TUNED}
    assert all(v.name.split("_st2_")[1].startswith("wgmma") for v in wgmma)


def test_wgmma_variant_refuses_other_archs():
    variant = next(v for v in SHIPPED if v.family == "wgmma")
    with pytest.raises(ValueError, match="sm_90"):
        jit.build(variant, "sm_80")
    assert not variant.runs_on("sm_80") and variant.runs_on("sm_90")


def test_generated_wgmma_header_is_current():
    """kernels/wgmma_ops.cuh is what tools/gen_wgmma_ops.py writes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "gen_wgmma_ops.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma_ops", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.target().read_text() == gen.render()


# ----------------------------------------------------------------------------- NVRTC through CuPy
@pytest.fixture
def fresh_nvrtc():
    """Forget the NVRTC bindings found so far (before and after the test)."""
    for cached in (compiler._nvrtc, compiler.nvrtc_version, compiler.supported_archs):
        cached.cache_clear()
    yield
    for cached in (compiler._nvrtc, compiler.nvrtc_version, compiler.supported_archs):
        cached.cache_clear()


def test_missing_nvrtc_bindings_are_a_compile_error_naming_them(monkeypatch, fresh_nvrtc):
    import sys

    bindings = pytest.importorskip("cuda.bindings")
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import fails
    # once imported anywhere, the submodule is also an attribute of its package, which
    # `from cuda.bindings import nvrtc` reads before sys.modules
    monkeypatch.delattr(bindings, "nvrtc", raising=False)
    with pytest.raises(CompileError, match="cuda.bindings.nvrtc"):
        compiler.nvrtc_version()


def test_nvrtc_status_is_a_compile_error_naming_the_call(monkeypatch, fresh_nvrtc):
    from cuda.bindings import nvrtc

    monkeypatch.setattr(nvrtc, "nvrtcGetSupportedArchs",
                        lambda: (nvrtc.nvrtcResult.NVRTC_ERROR_OUT_OF_MEMORY, []))
    with pytest.raises(CompileError, match="nvrtcGetSupportedArchs returned NVRTC_ERROR_OUT_OF_MEMORY"):
        compiler.supported_archs()


def test_a_failed_compile_carries_the_log_and_options(fresh_nvrtc):
    with pytest.raises(CompileError, match=r"(?s)NVRTC failed to compile bad for sm_80.*options: -arch=sm_80.*error"):
        compiler.compile_cubin('extern "C" __global__ void k() { undeclared = 1; }', name="bad", arch="sm_80")


SMALL_KERNELS = [
    pytest.param('extern "C" __global__ void k(int* p) { p[threadIdx.x] = threadIdx.x * 3; }', "sm_80", id="sm80"),
    pytest.param('extern "C" __global__ void k(float* p) { p[threadIdx.x] = __expf(p[threadIdx.x]); }', "sm_90a",
                 id="sm90a"),
]


def _elf_end(image: bytes) -> int:
    """Where an ELF64 image's section and program header tables end (the image's declared size)."""
    import struct

    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


@pytest.mark.parametrize("source,arch", SMALL_KERNELS)
def test_cubins_match_cupys_nvrtc_path_all_but_cupys_dropped_last_byte(source, arch, fresh_nvrtc):
    """Issue 36: moving from CuPy's private bindings to cuda.bindings changes no binary (same NVRTC,
    same options) but the byte CuPy's binding cut off. The shipped kernels were compared the same way."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    result = compiler.compile_cubin(source, name="k", arch=arch)
    if tuple(nvrtc.getVersion()) != compiler.nvrtc_version():
        pytest.skip("CuPy loads another NVRTC")
    prog = nvrtc.createProgram(source, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(result.options))
        through_cupy = bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    # CuPy's binding drops the image's last byte (it reads the buffer as a NUL-terminated string);
    # every other byte is the same, and the ELF's own tables end exactly where NVRTC's size says.
    assert result.cubin[:-1] == through_cupy and len(result.cubin) == len(through_cupy) + 1
    assert _elf_end(result.cubin) == len(result.cubin)
    assert result.registers is not None and "ptxas" in result.log and "\0" not in result.log


# ----------------------------------------------------------------------------- device arch
class _FakeDevice:
    cc = "90"

    def __init__(self, device_id=None):
        self.compute_capability = _FakeDevice.cc


@pytest.mark.parametrize("cc, nvrtc_knows, expected", [
    pytest.param("75", (75, 80, 90), "NoGPUError", id="turing-refused"),
    pytest.param("70", (70, 80, 90), "NoGPUError", id="volta-refused"),
    pytest.param("80", (80, 86, 90), "sm_80", id="a100"),
    pytest.param("89", (80, 86, 90), "sm_86", id="ada-newest-minor-known"),
    pytest.param("90", (80, 86, 89, 90, 100), "sm_90", id="h100"),
    pytest.param("100", (80, 86, 89, 90), "CompileError", id="major-unknown-to-nvrtc"),
])
def test_device_arch(monkeypatch, cc, nvrtc_knows, expected):
    import cupy

    from omnicupy.errors import NoGPUError

    monkeypatch.setattr(_FakeDevice, "cc", cc)
    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda i: {"name": b"Some GPU"})
    monkeypatch.setattr(jit, "supported_archs", lambda: nvrtc_knows)
    jit._device_arch.cache_clear()
    try:
        if expected in ("NoGPUError", "CompileError"):
            error = NoGPUError if expected == "NoGPUError" else CompileError
            with pytest.raises(error, match="sm_80" if expected == "NoGPUError" else "compute capability"):
                jit.device_arch(0)
        else:
            assert jit.device_arch(0) == expected
    finally:
        jit._device_arch.cache_clear()


def test_bad_arch_is_an_argument_error():
    from omnicupy.errors import ArgumentError

    with pytest.raises(ArgumentError, match="sm_80"):
        compiler.normalize_arch("hopper")


_PTXAS_LOG = """ptxas info    : Compiling entry function 'k_dq' for 'sm_90'
ptxas info    : Function properties for k_dq
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers
ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     80 bytes stack frame, 112 bytes spill stores, 80 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 80 bytes cumulative stack size
"""


@pytest.mark.parametrize("log, name, expected", [
    pytest.param(_PTXAS_LOG, "k", (255, 192), id="the-named-entry-not-the-first"),
    pytest.param(_PTXAS_LOG, "k_dq", (22, 0), id="a-sibling-by-name"),
    pytest.param(_PTXAS_LOG, "other", (255, 192), id="no-such-entry-the-most-of-any"),
    pytest.param("", "k", (None, None), id="no-report"),
])
def test_compile_reports_the_variants_own_entry(log, name, expected):
    """A module of several entry points (the backward's preprocess, main and conversion) is reported
    by the variant's own kernel: the cache once recorded whichever ptxas listed first (the backward's
    conversion kernel: 22 registers, no spills, for a main kernel at 255 that spills)."""
    assert compiler._named_report(log, name) == expected


def test_nvrtc_buffers_are_never_shared_bytes_objects():
    """NVRTC writes into the buffer it is given. ``b" " * 1`` is CPython's shared one-byte object, so
    a one-byte buffer (an empty log) made that way once turned every b" " in the process into NUL
    (torch then failed to parse its own operator schemas). Each buffer must be a fresh bytearray."""
    nvrtc = compiler._nvrtc()
    seen = []

    def size_function(prog):
        return nvrtc.nvrtcResult.NVRTC_SUCCESS, 1

    def get_function(prog, buffer):
        seen.append(buffer)
        buffer[0] = 0  # what NVRTC does with an empty log
        return (nvrtc.nvrtcResult.NVRTC_SUCCESS,)

    out = compiler._bytes_out("nvrtcGetProgramLog", size_function, get_function, None)
    assert out == b"\0" and isinstance(seen[0], bytearray)
    assert bytes([32]) == b" " and (b" " * 1)[0] == 32  # the shared object is untouched
    compiler.compile_ptx('extern "C" __global__ void k() {}', name="k")
    compiler.compile_cubin('extern "C" __global__ void k() {}', name="k", arch="sm_80")
    assert bytes([32]) == b" "
