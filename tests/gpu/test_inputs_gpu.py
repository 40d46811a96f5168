"""Input validation with device arrays (issue 17): outputs that alias inputs or themselves, lookup
arrays that would narrow or be read out of bounds, scalars the kernel cannot hold, sizes it cannot
index. Every bad call must raise a named omnicupy error before anything is launched; the good
neighbours of each case still compute the right result.
"""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, reference
from omnicupy.errors import AliasError, ArgumentError, ExpressionError, SizeLimitError

from helpers import TOLERANCE, random_qkv, run_and_check, seed_note, seeded_rng

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def device_qkv(rng, B=1, H=2, N=200, D=64):
    return tuple(cp.asarray(x) for x in random_qkv(rng, B, H, N, D, "fp16"))


# ---------------------------------------------------------------- out
def test_out_aliasing_an_input_is_refused_before_launch():
    q, k, v = device_qkv(seeded_rng())
    k_before = k.copy()
    for out, name in ((k, "k"), (q[:, :, ::-1], "q"), (v, "v")):
        with pytest.raises(AliasError, match=f"out shares memory with {name}"):
            omnicupy.attention(q, k, v, causal=True, out=out)
    cp.testing.assert_array_equal(k, k_before)


def test_out_in_a_packed_buffer_is_fine():
    """q, k, v and out as four slots of one [B, N, 4, H, D] buffer: disjoint, accepted, correct."""
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 200, 64, "fp16")
    buf = cp.full((1, 200, 4, 2, 64), np.nan, dtype=np.float16)
    views = [buf[:, :, i].transpose(0, 2, 1, 3) for i in range(4)]
    for view, x in zip(views, (q, k, v)):
        view[...] = cp.asarray(x)
    got = omnicupy.attention(*views[:3], causal=True, out=views[3])
    assert got is views[3]
    qi, ki = np.arange(200)[:, None], np.arange(200)[None, :]
    err = reference.relative_error(got.get(), reference.attention(q, k, v, qi >= ki))
    assert err <= TOLERANCE["fp16"], f"relative error {err:.2e}" + seed_note()


def test_self_overlapping_out_is_refused():
    q, k, v = device_qkv(seeded_rng())
    base = cp.zeros((1, 2, 1, 64), np.float16)
    zero_stride = cp.lib.stride_tricks.as_strided(base, q.shape, (base.strides[0], base.strides[1], 0, 2))
    with pytest.raises(AliasError, match="overlapping elements"):
        omnicupy.attention(q, k, v, out=zero_stride)


def test_low_level_output_aliasing():
    """omni_attn_mma_blockmask: o must not be q; lse must not overlap o (check_lse_buffer)."""
    q, k, v = device_qkv(seeded_rng())
    bm = BlockMask.causal(200, 200)
    meta = [cp.asarray(a) for a in (bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types)]
    with pytest.raises(AliasError, match="o shares memory with q"):
        omnicupy.omni_attn_mma_blockmask(q, k, v, q, *meta)
    o = cp.zeros_like(q)
    lse_inside_o = o.reshape(-1).view(cp.float32)[:400].reshape(1, 2, 200)
    with pytest.raises(AliasError, match="lse shares memory with"):
        omnicupy.omni_attn_mma_blockmask(q, k, v, o, *meta, lse=lse_inside_o)


# ---------------------------------------------------------------- lookup arrays
def test_device_int64_ids_beyond_int32_are_refused_and_small_ones_kept():
    big = cp.asarray(np.array([2**32 + 1, 1, 1], np.int64))
    with pytest.raises(ExpressionError, match="outside int32"):
        omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": big})
    small = cp.arange(300, dtype=cp.int64) // 100
    cm = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": small})
    stored, = cm.cuda.arrays
    assert isinstance(stored, cp.ndarray) and stored.dtype == cp.int32
    small[:] = 0  # the mask owns its copy
    assert int(stored[299]) == 2


def test_short_lookup_array_is_refused_by_the_builder():
    """Issue 17: a 4-element table read at q_idx up to 255. The GPU builder evaluates the expression
    with a CuPy elementwise kernel: the index ranges are checked before that launch."""
    cm = omnicupy.cuda_mask("t[q_idx] == t[kv_idx]", arrays={"t": cp.zeros(4, cp.int32)})
    with pytest.raises(ExpressionError, match="has 4 elements"):
        BlockMask.from_mask_mod(cm, None, None, 256, 256, q_block_size=64, kv_block_size=64)


def test_short_lookup_array_is_refused_by_attention():
    """Needs ops/forward.py to call inputs.check_expressions on the fused expressions (the lead's wiring)."""
    rng = seeded_rng()
    q, k, v = device_qkv(rng, N=256)
    slope = omnicupy.cuda_score("score + s[h] + t[q_idx]", arrays={"s": np.zeros(2, np.float32),
                                                                   "t": np.zeros(100, np.float32)})
    with pytest.raises(ExpressionError, match="'t'.*has 100 elements"):
        omnicupy.attention(q, k, v, score_mod=slope)
    doc = np.repeat(np.arange(4), [50, 70, 64, 72]).astype(np.int32)  # boundaries inside blocks: PARTIAL ones
    cm = omnicupy.cuda_mask("doc[q_idx] == doc[kv_idx] && h < 2 && t[b] == 0",
                            arrays={"doc": doc, "t": np.zeros(1, np.int32)})
    bm = BlockMask.from_mask_mod(cm, None, None, 256, 256, q_block_size=64, kv_block_size=64)
    q2, k2, v2 = device_qkv(rng, B=2, N=256)
    with pytest.raises(ExpressionError, match="'t'.*has 1 elements"):
        omnicupy.attention(q2, k2, v2, bm, fuse_mask=True)  # batch 2 reads t[1]


def test_elementwise_tanh_fast_matches_the_numpy_form():
    """A cuda_score without a NumPy form that calls omni::tanh_fast evaluates on the GPU (the
    elementwise kernel defines it as the attention kernels do)."""
    rng = seeded_rng()
    mod = omnicupy.cuda_score("CAP * omni::tanh_fast(score * INV)", {"CAP": 5.0, "INV": 0.2})
    s = cp.asarray(rng.standard_normal((16, 32)).astype(np.float32) * 10)
    got = mod(s, 0, 0, cp.arange(16)[:, None], cp.arange(32)[None, :])
    np.testing.assert_allclose(got.get(), 5.0 * np.tanh(s.get() / 5.0), atol=1e-5, err_msg=seed_note())


# ---------------------------------------------------------------- scalars and sizes
@pytest.mark.parametrize("scale,message", [
    pytest.param(1e300, "float32", id="inf-in-float32"),
    pytest.param(3e38, "<=", id="inf-after-log2e"),
    pytest.param("0.5", "real number", id="string"),
    pytest.param(True, "real number", id="bool"),
])
def test_scale_that_the_kernel_cannot_hold(scale, message):
    q, k, v = device_qkv(seeded_rng())
    with pytest.raises(ArgumentError, match=message):
        omnicupy.attention(q, k, v, scale=scale)


def test_huge_sequences_fail_before_any_allocation():
    row = cp.zeros((1, 1, 1, 64), cp.float16)
    huge = cp.broadcast_to(row, (1, 1, 2**31, 64))
    free_before = cp.cuda.Device().mem_info[0]
    with pytest.raises(SizeLimitError, match="sequence length"):
        omnicupy.attention(huge, huge, huge)
    host = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float16), huge.shape)
    with pytest.raises(SizeLimitError, match="sequence length"):
        omnicupy.attention(host, host, host)  # NumPy: nothing copied to the device
    assert cp.cuda.Device().mem_info[0] >= free_before - (64 << 20)


def test_a_good_neighbour_still_runs():
    """Largest allowed values near the limits still compute correctly (scale at float32's edge is
    allowed but not tested for accuracy; an ordinary one is)."""
    rng = seeded_rng()
    q, k, v = random_qkv(rng, 1, 2, 130, 64, "fp16")
    qi, ki = np.arange(130)[:, None], np.arange(130)[None, :]
    run_and_check(q, k, v, (qi >= ki)[None, None], "fp16", causal=True, scale=np.float32(0.1))
