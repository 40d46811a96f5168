"""omnicupy.jax without a GPU: argument errors at trace time, abstract shapes (jit, grad, vmap),
the custom calls in the jaxpr and the lowered program, and the FFI handler's C ABI against XLA's
CPU runtime (a test handler registered for the CPU platform decodes buffers, attributes and
errors exactly as the CUDA handlers do)."""
from __future__ import annotations

import ctypes
import inspect

import os

import numpy as np
import pytest

# Other suites in the same process (CuPy, torch) need memory too: XLA grows its pool on demand.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import omnicupy  # noqa: E402
import omnicupy.jax as oj  # noqa: E402
from omnicupy import BlockMask, masks  # noqa: E402
from omnicupy.adapters import jax_exec, specs, xla_ffi  # noqa: E402

B, N, HQ, HKV, D = 2, 256, 4, 2, 64
WINDOW = BlockMask.from_mask_mod(masks.sliding_window(64), None, None, N, N)


def arr(*shape, dtype=jnp.float16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = arr(B, N, HQ, D), arr(B, N, HKV, D)


@pytest.mark.parametrize("args, kwargs, error, match", [
    pytest.param((Q, KV, KV), {"layout": "NBHD"}, omnicupy.ArgumentError, "layout", id="layout"),
    pytest.param((arr(N, HQ, D), KV, KV), {}, omnicupy.ArgumentError, "4-D", id="rank"),
    pytest.param((arr(B, N, HQ, D, dtype=jnp.float32), KV, KV), {}, omnicupy.ArgumentError, "float16 or bfloat16",
                 id="fp32"),
    pytest.param((Q, arr(B, N, HKV, D, dtype=jnp.bfloat16), KV), {}, omnicupy.ArgumentError, "share a dtype",
                 id="mixed"),
    pytest.param((arr(B, N, 3, D), KV, KV), {}, omnicupy.ArgumentError, "multiple of kv heads", id="gqa"),
    pytest.param((Q, KV, arr(B, N, HKV, 32)), {}, omnicupy.ArgumentError, "one shape", id="kv-shapes"),
    pytest.param((arr(B, 128, HQ, D), KV, KV), {"block_mask": WINDOW}, omnicupy.MaskError, "q_len=256",
                 id="mask-size"),
    pytest.param((Q, KV, KV), {"block_mask": WINDOW, "causal": True}, omnicupy.ArgumentError, "either block_mask",
                 id="mask-and-causal"),
    pytest.param((Q, KV, KV), {"causal": "left"}, omnicupy.ArgumentError, "causal must be", id="causal-value"),
    pytest.param((Q, KV, KV), {"scale": -1.0}, omnicupy.ArgumentError, "scale", id="scale"),
    pytest.param((Q, KV, KV), {"block_mask": "mask"}, omnicupy.ArgumentError, "omnicupy.BlockMask", id="mask-type"),
])
def test_bad_arguments_are_refused_at_trace_time(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda q, k, v: oj.attention(q, k, v, **kwargs), *args)


@pytest.mark.parametrize("layout", ["BNHD", "BHND"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_abstract_shapes_of_forward_lse_and_gradients(dtype, layout):
    q, kv = (arr(B, N, h, D, dtype=dtype) if layout == "BNHD" else arr(B, h, N, D, dtype=dtype) for h in (HQ, HKV))
    out, lse = jax.eval_shape(lambda q, k, v: oj.attention(q, k, v, WINDOW, layout=layout, return_lse=True), q, kv, kv)
    assert (out.shape, out.dtype) == (q.shape, dtype) and (lse.shape, lse.dtype) == ((B, HQ, N), jnp.float32)

    def loss(q, k, v):
        out, lse = oj.attention(q, k, v, WINDOW, layout=layout, return_lse=True)
        return out.astype(jnp.float32).sum() + lse.sum()  # the LSE adds no gradient

    grads = jax.eval_shape(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, kv, kv)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype), (kv.shape, dtype), (kv.shape, dtype)]


def test_jaxpr_holds_the_custom_calls_with_the_spec_attribute():
    def loss(q, k, v):
        return oj.attention(q, k, v, WINDOW).astype(jnp.float32).sum()

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(Q, KV, KV))
    assert f"target_name={jax_exec.FORWARD_TARGET}" in text and f"target_name={jax_exec.BACKWARD_TARGET}" in text
    key = specs.register(specs.CallSpec(WINDOW, False, None, None, False, False, layout="BNHD"))
    assert f"('spec', np.int64({key}))" in text
    lowered = jax.jit(jax.grad(loss)).lower(Q, KV, KV).as_text()
    assert jax_exec.FORWARD_TARGET in lowered and jax_exec.BACKWARD_TARGET in lowered


def test_vmap_over_a_leading_axis_batches_the_custom_call():
    batched = jax.vmap(lambda q, k, v: oj.attention(q, k, v, causal=True))
    out = jax.eval_shape(batched, arr(3, *Q.shape), arr(3, *KV.shape), arr(3, *KV.shape))
    assert out.shape == (3, *Q.shape)
    text = str(jax.make_jaxpr(batched)(arr(3, *Q.shape), arr(3, *KV.shape), arr(3, *KV.shape)))
    assert "float16[3,2,256,4,64]" in text and jax_exec.FORWARD_TARGET in text


# ------------------------------------------------------------- the C ABI against XLA's CPU runtime
_seen: dict = {}


def _copy_plus_offset(frame: xla_ffi.Frame) -> None:
    """Test handler: ret0 = arg0 + attrs["offset"] (float32, host memory on the CPU platform)."""
    _seen.update(args=frame.args, rets=frame.rets, attrs=frame.attrs)
    if frame.attrs.get("fail"):
        raise omnicupy.ArgumentError("asked to fail")
    src, dst = frame.args[0], frame.rets[0]
    n = int(np.prod(src.shape))
    view = [np.ctypeslib.as_array(ctypes.cast(b.ptr, ctypes.POINTER(ctypes.c_float)), (n,)) for b in (src, dst)]
    view[1][:] = view[0] + frame.attrs["offset"]


_CALLBACK, _CAPSULE = xla_ffi.make_handler(_copy_plus_offset)
jax.ffi.register_ffi_target("omnicupy_test_copy", _CAPSULE, platform="cpu", api_version=1)


def _copy(x, **attrs):
    return jax.ffi.ffi_call("omnicupy_test_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x, **attrs)


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 3, 4, 5)], ids=["rank1", "rank2", "rank4"])
@pytest.mark.parametrize("offset", [np.int64(7), np.int32(-3), np.float32(0.5)], ids=["i64", "i32", "f32"])
def test_handler_reads_buffers_and_attributes(shape, offset):
    if jax.default_backend() != "cpu":
        pytest.skip("the ABI test handler is registered for the CPU platform")
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    got = jax.jit(lambda x: _copy(x, offset=offset))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x) + offset)
    assert [(b.dtype, b.shape) for b in _seen["args"]] == [("float32", shape)]
    assert _seen["attrs"] == {"offset": offset.item()}


def test_handler_turns_exceptions_into_xla_errors():
    if jax.default_backend() != "cpu":
        pytest.skip("the ABI test handler is registered for the CPU platform")
    x = jnp.zeros(4, jnp.float32)
    with pytest.raises(Exception, match="omnicupy: ArgumentError: asked to fail"):
        _copy(x, offset=np.int64(0), fail=np.int64(1)).block_until_ready()


def _context_probe(frame: xla_ffi.Frame) -> None:
    """Test handler: what the execution context gives on the CPU platform (a device ordinal; no
    stream and no device allocator, reported as FfiError with XLA's message)."""
    _seen["device"] = frame.device()
    for name, call in (("stream", frame.stream), ("allocate", lambda: frame.allocate(4096))):
        try:
            _seen[name] = call()
        except xla_ffi.FfiError as exc:
            _seen[name] = exc
    ret = frame.rets[0]
    ctypes.memset(ret.ptr, 0, 4 * int(np.prod(ret.shape)))


_PROBE = xla_ffi.make_handler(_context_probe)
jax.ffi.register_ffi_target("omnicupy_test_probe", _PROBE[1], platform="cpu", api_version=1)


def test_handler_reaches_the_api_function_table():
    """DeviceOrdinal_Get is the table's last entry: reaching it checks every offset before it."""
    if jax.default_backend() != "cpu":
        pytest.skip("the ABI test handler is registered for the CPU platform")
    x = jnp.ones(4, jnp.float32)
    jax.ffi.ffi_call("omnicupy_test_probe", jax.ShapeDtypeStruct(x.shape, x.dtype))(x).block_until_ready()
    assert _seen["device"] == 0
    for name in ("stream", "allocate"):
        assert isinstance(_seen[name], xla_ffi.FfiError) and "failed: " in str(_seen[name]), _seen[name]
        assert len(str(_seen[name]).split("failed: ", 1)[1]) > 0  # XLA's own message came through


# ------------------------------------------------------------- XLA's allocator: 16-byte alignment at most
@pytest.mark.parametrize("raw", [0x10000, 0x10010, 0x100F0, 0x10100 - 16], ids=["256-aligned", "16", "240", "last-16"])
@pytest.mark.parametrize("size", [1, 256, 4097], ids=["1B", "256B", "4097B"])
def test_blocks_from_xla_are_realigned_inside_what_was_allocated(raw, size):
    """XLA_FFI_DeviceMemory_Allocate refuses alignments above 16 (jaxlib 0.11's CUDA plugin:
    "Unsupported alignment: 256"): omnicupy asks for 16, over-allocates and rounds the pointer up
    to jax_exec.ALIGNMENT, and gives XLA back exactly the block it got."""
    asked, freed = [], []

    def allocate(nbytes):
        asked.append(nbytes)
        return raw

    ptr, owner = jax_exec.aligned_alloc(allocate, lambda p, n: freed.append((p, n)))(size)
    assert ptr % jax_exec.ALIGNMENT == 0 and raw <= ptr and ptr + size <= raw + asked[0]
    assert xla_ffi.MAX_ALIGNMENT == 16 and jax_exec.ALIGNMENT % 128 == 0  # TMA tensor maps: 128 B
    assert inspect.signature(xla_ffi.Frame.allocate).parameters["alignment"].default <= xla_ffi.MAX_ALIGNMENT
    assert not freed
    del owner
    assert freed == [(raw, asked[0])]


def test_a_misaligned_block_from_xla_is_given_back_and_reported():
    freed = []
    alloc = jax_exec.aligned_alloc(lambda n: 0x10008, lambda p, n: freed.append(p))
    with pytest.raises(xla_ffi.FfiError, match="not 16-byte aligned"):
        alloc(64)
    assert freed == [0x10008]
