"""compile_mask on the GPU: the emitted CUDA text, compiled by NVRTC (CuPy's elementwise kernel),
equals its host C emulation (numpy_fn) and the Python mask_mod on random masks and on every family;
BlockMask.from_mask_mod on the device (the compiled path) equals the host build."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

import omnicupy
from omnicupy import MaskError
from omnicupy.mask import families

import mask_mod_strategies as prop
from hypothesis import strategies as st

pytestmark = pytest.mark.gpu


def _grid(cp, batch, heads, q0, n_q, kv0, n_kv):
    return (cp.arange(batch).reshape(-1, 1, 1, 1), cp.arange(heads).reshape(1, -1, 1, 1),
            cp.arange(q0, q0 + n_q).reshape(1, 1, -1, 1), cp.arange(kv0, kv0 + n_kv).reshape(1, 1, 1, -1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=prop.bool_exprs, n_q=st.integers(1, 300), n_kv=st.integers(1, 300),
       q0=st.integers(0, 800), kv0=st.integers(0, 800))
def test_cuda_text_equals_its_host_emulation(expr, n_q, n_kv, q0, kv0):
    import cupy as cp

    fn, filename = prop._mask_from_source(expr, 7, -1234, 37)
    try:
        compiled = omnicupy.compile_mask(fn)
    except MaskError:
        assume(False)
    assume(compiled.why_not(batch=2, heads=3, q_len=q0 + n_q, kv_len=kv0 + n_kv) is None)
    shape = (2, 3, n_q, n_kv)
    on_device = cp.broadcast_to(compiled(*_grid(cp, 2, 3, q0, n_q, kv0, n_kv)), shape).get()
    on_host = np.broadcast_to(compiled(*(x.get() for x in _grid(cp, 2, 3, q0, n_q, kv0, n_kv))), shape)
    python = np.broadcast_to(fn(*(x.get() for x in _grid(cp, 2, 3, q0, n_q, kv0, n_kv))), shape)
    np.testing.assert_array_equal(on_device, on_host, err_msg=compiled.cuda.text)
    np.testing.assert_array_equal(on_host, python)


@pytest.mark.parametrize("n", [1000, 4099])
@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_family_builds_on_the_device_as_on_the_host(name, n):
    import cupy as cp

    fn, nq, nkv = families.examples(n, [name])[name]
    on_device = omnicupy.BlockMask.from_mask_mod(fn, None, None, nq, nkv, xp=cp)
    on_host = omnicupy.BlockMask.from_mask_mod(fn, None, None, nq, nkv, xp=np)
    assert on_device.mask_mod is fn
    np.testing.assert_array_equal(on_device.to_dense(), on_host.to_dense())
    assert on_device.summary.counts == on_host.summary.counts
