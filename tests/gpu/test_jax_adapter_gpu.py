"""omnicupy.jax on a GPU: jitted forward and gradients against omnicupy's own calls on the same
buffers (same kernels), against jax.nn.dot_product_attention with an explicit mask, GQA, fp16 and
bf16, both layouts, vmap, XLA's stream and allocator, and errors raised inside the custom call."""
from __future__ import annotations

import os

import numpy as np
import pytest

# Other suites in the same process (CuPy, torch) need memory too: XLA grows its pool on demand.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import omnicupy  # noqa: E402
from omnicupy import BlockMask, masks  # noqa: E402

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cp = pytest.importorskip("cupy")
if jax.default_backend() != "gpu":
    pytest.skip("jax without a GPU backend", allow_module_level=True)

import omnicupy.jax as oj  # noqa: E402
from omnicupy.adapters import jax_exec  # noqa: E402

N = 512
DOCS = masks.doc_ids_from_lengths([200, 100, 212])
RULES = {"causal": masks.causal(), "window": masks.sliding_window(100), "documents": masks.document(DOCS)}
TOL = {jnp.float16: 3e-3, jnp.bfloat16: 2e-2}


def new_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def inputs(seed, dtype=jnp.float16, layout="BNHD", B=2, Hq=4, Hkv=2, D=64):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (lambda h: (B, N, h, D)) if layout == "BNHD" else (lambda h: (B, h, N, D))
    q = jax.random.normal(keys[0], shape(Hq), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(kk, shape(Hkv), jnp.float32).astype(dtype) for kk in keys[1:3])
    dout = jax.random.normal(keys[3], shape(Hq), jnp.float32).astype(dtype)
    return q, k, v, dout


def to_bhnd(x, layout):
    """A CuPy [B, H, N, D] view of a jax array (DLPack, zero-copy)."""
    c = cp.from_dlpack(x)
    return c.transpose(0, 2, 1, 3) if layout == "BNHD" else c


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("layout", ["BNHD", "BHND"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_jit_forward_and_grad_match_omnicupy(rule, layout, dtype):
    seed = new_seed()
    q, k, v, dout = inputs(seed, dtype, layout)
    bm = BlockMask.from_mask_mod(RULES[rule], None, None, N, N)

    def fwd(q, k, v):
        return oj.attention(q, k, v, bm, layout=layout)

    out, vjp = jax.vjp(jax.jit(fwd), q, k, v)
    grads = jax.jit(vjp)(dout)
    out_c, lse_c = omnicupy.attention(*(to_bhnd(x, layout) for x in (q, k, v)), bm, return_lse=True)
    want = omnicupy.attention_backward(to_bhnd(dout, layout), *(to_bhnd(x, layout) for x in (q, k, v)), out_c, lse_c,
                                       bm)
    err = rel(cp.asnumpy(to_bhnd(out, layout).astype(cp.float32)), cp.asnumpy(out_c.astype(cp.float32)))
    assert err <= 1e-3, f"forward: {err:.2e} from omnicupy's (the same kernel; seed {seed})"
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        err = rel(cp.asnumpy(to_bhnd(g, layout).astype(cp.float32)), cp.asnumpy(w.astype(cp.float32)))
        assert err <= TOL[dtype], f"{name}: {err:.2e} from omnicupy's backward (seed {seed})"


@pytest.mark.parametrize("rule", sorted(RULES))
def test_matches_dot_product_attention_with_an_explicit_mask(rule):
    seed = new_seed()
    q, k, v, _ = inputs(seed)
    bm = BlockMask.from_mask_mod(RULES[rule], None, None, N, N)
    dense = jnp.asarray(omnicupy.reference.dense_mask_from_mod(RULES[rule], 1, 1, N, N))  # [1, 1, N, N]

    def loss_omni(q, k, v):
        return jnp.sum(oj.attention(q, k, v, bm).astype(jnp.float32) ** 2)

    def loss_xla(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=dense).astype(jnp.float32) ** 2)

    got = jax.jit(jax.value_and_grad(loss_omni, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(loss_xla, argnums=(0, 1, 2)))(q, k, v)
    assert rel(got[0], want[0]) < 1e-2, f"loss (seed {seed})"
    for name, g, w in zip(("dq", "dk", "dv"), got[1], want[1]):
        assert rel(g, w) < 2e-2, f"{name} (seed {seed})"


def test_vmap_over_a_leading_axis_equals_a_loop():
    seed = new_seed()
    stacked = [inputs(seed + i)[:3] for i in range(3)]
    q, k, v = (jnp.stack(xs) for xs in zip(*stacked))
    got = jax.jit(jax.vmap(lambda q, k, v: oj.attention(q, k, v, causal=True)))(q, k, v)
    for i, (qi, ki, vi) in enumerate(stacked):
        want = oj.attention(qi, ki, vi, causal=True)
        assert bool(jnp.array_equal(got[i], want)), f"vmap slice {i} (seed {seed})"


def test_runs_on_xlas_stream_with_xlas_memory():
    """The handler launches on the stream XLA gave it (not CuPy's default), and CuPy's own
    allocator is never asked for memory inside the call (it is made to refuse here)."""
    def refuse(size):
        raise AssertionError(f"CuPy allocated {size} bytes outside XLA's allocator")

    q, k, v, _ = inputs(new_seed())
    bm = BlockMask.from_mask_mod(masks.sliding_window(64), None, None, N, N)
    loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(oj.attention(q, k, v, bm).astype(jnp.float32))))
    loss(q, k, v).block_until_ready()  # traced (the mask's tables built at trace time, in CuPy's pool)
    jax_exec.last_stream[0] = 0
    cp.cuda.set_allocator(refuse)  # process-wide: XLA may call the handler from a thread of its own
    try:
        loss(q, k, v).block_until_ready()
    finally:
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
    assert jax_exec.last_stream[0] not in (0, cp.cuda.Stream.null.ptr)


def test_errors_inside_the_custom_call_reach_the_caller():
    """A per-batch mask no longer matches once vmap folds its axis into the batch."""
    q, k, v, _ = inputs(new_seed(), B=2)
    per_batch = BlockMask.from_mask_mod(masks.causal(), 2, None, N, N)
    batched = jax.jit(jax.vmap(lambda q, k, v: oj.attention(q, k, v, per_batch)))
    with pytest.raises(Exception, match="MaskError"):
        batched(*(jnp.stack([x, x]) for x in (q, k, v))).block_until_ready()
