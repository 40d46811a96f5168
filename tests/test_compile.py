"""Render and NVRTC-compile every shipped variant for sm_80 and sm_90 (no GPU needed)."""
from __future__ import annotations

import pytest

from omnicupy import jit, tiles
from omnicupy.errors import CompileError
from omnicupy.jit import compiler, render
from omnicupy.jit.cache import DiskCache

SHIPPED = tiles.shipped_variants()
ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("kernel-cache"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", SHIPPED, ids=lambda v: v.name)
def test_shipped_variant_compiles(variant, arch, compile_cache):
    entry, built = jit.build(variant, arch, cache=compile_cache)
    assert built
    assert entry.size > 1000 and entry.meta["kernel"] == variant.name and entry.meta["arch"] == arch
    assert entry.meta["registers"] is not None and entry.meta["registers"] <= 255
    # A second request is a verified cache hit, not a recompile.
    again, built_again = jit.build(variant, arch, cache=compile_cache)
    assert not built_again and again.binary_path == entry.binary_path


def test_kernel_names_are_unique():
    assert len({v.name for v in SHIPPED}) == len(SHIPPED)
    for v in SHIPPED[:4]:
        assert f'extern "C" __global__ void __launch_bounds__(kThreads) {v.name}(' in render.render_source(v)


def test_template_is_strict():
    """A missing template parameter is an error, never an empty string in the kernel."""
    import jinja2

    template = render._environment().get_template(render.TEMPLATE_NAME)
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
