"""Kernel features on a GPU (issue: GQA, cross lengths, bias, fused mask and score modifiers),
alone and combined, against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, score_mods
from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS

from helpers import NP_DTYPES, random_block_mask, random_qkv, run_and_check, seed_note, seeded_rng
from mask_cases import MASK_CASES

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def random_bias(rng, shape, dtype):
    return (rng.standard_normal(shape) * 2).astype(np.float32 if dtype == "fp32" else NP_DTYPES[dtype])


# ---------------------------------------------------------------- bias
@pytest.mark.parametrize("kind", ["vector", "matrix", "vector-bcast", "matrix-bcast", "matrix-strided"])
@pytest.mark.parametrize("bias_dtype", ["fp16", "bf16", "fp32"])
def test_bias(kind, bias_dtype):
    rng = seeded_rng()
    B, H, Nq, Nkv = 2, 4, 300, 333
    q, k, v = random_qkv(rng, B, H, Nq, 64, "fp16", Nkv=Nkv)
    shape = {"vector": (B, H, Nkv), "matrix": (B, H, Nq, Nkv), "vector-bcast": (1, H, Nkv),
             "matrix-bcast": (B, 1, Nq, Nkv), "matrix-strided": (B, H, Nkv, Nq)}[kind]
    bias = random_bias(rng, shape, bias_dtype)
    if kind == "matrix-strided":  # a transposed view: neither last-dim nor row contiguous
        bias = cp.asarray(bias).transpose(0, 1, 3, 2)
    run_and_check(q, k, v, np.ones((1, 1, Nq, Nkv), bool), "fp16", bias=bias)


# ---------------------------------------------------------------- score modifiers
DOC_SLOPES = np.linspace(0.0, 1.0, 16, dtype=np.float32)
SCORE_MODS = [
    pytest.param(lambda H: score_mods.alibi(H), id="alibi"),
    pytest.param(lambda H: score_mods.softcap(3.0), id="softcap"),
    pytest.param(lambda H: omnicupy.cuda_score(
        "score - PENALTY * (float)(q_idx > kv_idx + GAP) + slope[h]", {"PENALTY": 0.75, "GAP": 20}, {"slope": DOC_SLOPES},
        numpy_fn=lambda s, b, h, q, k: s - 0.75 * (q > k + 20) + DOC_SLOPES[h]), id="user-expression-with-array"),
]


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("factory", SCORE_MODS)
def test_score_mods(factory, stages):
    rng = seeded_rng()
    B, H, N = 2, 4, 400
    q, k, v = random_qkv(rng, B, H, N, 64, "fp16")
    qi, ki = np.arange(N)[:, None], np.arange(N)[None, :]
    run_and_check(q, k, v, (qi >= ki)[None, None], "fp16", causal=True, score_mod=factory(H), stages=stages)


# ---------------------------------------------------------------- causal conventions
@pytest.mark.parametrize("q_len,kv_len", [(1, 1000), (7, 1000), (300, 1000), (1000, 1000), (1000, 300), (129, 4097)])
@pytest.mark.parametrize("mode", ["top_left", "bottom_right"])
def test_causal_modes(q_len, kv_len, mode):
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 2, 2, q_len, 128, "bf16", Nkv=kv_len)
    offset = kv_len - q_len if mode == "bottom_right" else 0
    dense = (np.arange(q_len)[:, None] + offset >= np.arange(kv_len)[None, :])[None, None]
    run_and_check(q, k, v, dense, "bf16", causal=mode)


# ---------------------------------------------------------------- fused masks
@pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])
def test_fused_mask_equals_bitmask(factory):
    """Built-in masks with a CUDA expression: PARTIAL blocks evaluated in the kernel give exactly the
    output of the stored bits, and both match the reference."""
    rng = seeded_rng()
    n = 777
    mask_mod = factory(n, n)
    bm = BlockMask.from_mask_mod(mask_mod, None, None, n, n)
    q, k, v = random_qkv(rng, 2, 2, n, 64, "fp16")
    dense = omnicupy.reference.dense_mask_from_mod(mask_mod, 1, 1, n, n)
    _, fused = run_and_check(q, k, v, dense, "fp16", block_mask=bm, fuse_mask=True)
    _, bits = run_and_check(q, k, v, dense, "fp16", block_mask=bm, fuse_mask=False)
    np.testing.assert_array_equal(fused, bits, err_msg=seed_note())


def test_cuda_mask_drives_the_builder_and_the_kernel():
    """One expression, with a constant and a device array, builds the BlockMask on the GPU (CuPy
    elementwise kernel) and is fused into attention."""
    rng = seeded_rng()
    n = 1000
    doc = np.repeat(np.arange(10), 100).astype(np.int32)
    cm = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && q_idx - kv_idx < W && q_idx >= kv_idx",
                            constants={"W": 70}, arrays={"doc": doc})
    bm = BlockMask.from_mask_mod(cm, None, None, n, n, q_block_size=64, kv_block_size=64)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = (doc[qi] == doc[ki]) & (qi - ki < 70) & (qi >= ki)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], dense)
    q, k, v = random_qkv(rng, 1, 2, n, 64, "fp16")
    run_and_check(q, k, v, dense[None, None], "fp16", block_mask=bm, fuse_mask=True)


def test_bad_expression_names_it():
    """An unknown name is refused by the grammar before anything renders; an expression the grammar
    allows but NVRTC rejects (a wrong argument count) is a CompileError carrying the expression."""
    q, k, v = (cp.zeros((1, 1, 64, 64), cp.float16) for _ in range(3))
    with pytest.raises(omnicupy.errors.ExpressionError, match="no_such_function"):
        omnicupy.cuda_score("no_such_function(score)")
    with pytest.raises(omnicupy.CompileError, match=r"fminf\(score\)"):
        omnicupy.attention(q, k, v, score_mod=omnicupy.cuda_score("fminf(score)"))


# ---------------------------------------------------------------- all together
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_everything_combined(head_dim, dtype, stages):
    """GQA + matrix bias + random mixed blocks (partial, causal, empty rows) + softcap + odd lengths."""
    rng = seeded_rng()
    B, Hq, Hkv, Nq, Nkv = 2, 4, 2, 261, 389
    q, k, v = random_qkv(rng, B, Hq, Nq, head_dim, dtype, Hkv=Hkv, Nkv=Nkv)
    bm, dense = random_block_mask(rng, B, Hq, Nq, Nkv, 128, 128, empty_q_blocks=1, shuffle=True)
    bias = random_bias(rng, (B, 1, Nq, Nkv), "fp32")
    run_and_check(q, k, v, dense, dtype, block_mask=bm, stages=stages, bias=bias, score_mod=score_mods.softcap(4.0))
