"""fp8 element traits (kernels/element.cuh) are enough for a kernel: the mma.sync forward renders
with an fp8 KV cache (16-bit Q and O, e4m3 / e5m2 K and V, converted to fp16 in registers by
kernels/mma_fp8.cuh) and compiles with NVRTC. Compile only: no shipped variant, no CLI entry.

The KV element type is the template value ``kv_dtype``, which the host does not produce yet; this
test passes it beside the variant's own values."""
from __future__ import annotations

import pytest

from omnicupy.dispatch.variant import Variant
from omnicupy.jit import env
from omnicupy.jit.compiler import compile_cubin
from omnicupy.jit.render import _environment, render_source

# A tuned mma.sync tile (D = 64, two stages) with every mask feature on.
BASE = Variant(64, "fp16", 128, 128, 4, 2, True, True)


def render_with_kv(variant: Variant, kv_dtype: str) -> str:
    return _environment().get_template(variant.template).render(**variant.template_params(), kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("arch", ["sm_89", "sm_90a"])
def test_fp8_kv_cache_forward_compiles(kv_dtype, arch):
    source = render_with_kv(BASE, kv_dtype)
    assert f"using KvElem = omni::Element<omni::Dtype::{kv_dtype}>;" in source
    assert "using QElem = omni::Element<omni::Dtype::fp16>;" in source
    result = compile_cubin(source, name=BASE.name, arch=arch, include_dirs=[env.kernels_dir()])
    assert result.registers is not None and result.registers <= 255  # the variant's own entry was built
    sixteen_bit = compile_cubin(render_source(BASE), name=BASE.name, arch=arch, include_dirs=[env.kernels_dir()])
    assert result.cubin != sixteen_bit.cubin  # the fp8 path, not the 16-bit one


def test_without_kv_dtype_the_source_is_the_shipped_one():
    # the default keeps K and V at Q's type: the rendered source of every shipped variant is unchanged
    assert render_with_kv(BASE, "fp16") == render_source(BASE)
