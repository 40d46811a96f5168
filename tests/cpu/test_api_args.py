"""Bad input raises a clear error naming the argument, before any launch (checked on the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, BlockMask, MaskError
from omnicupy.errors import AliasError, SizeLimitError
from omnicupy.ops.inputs import MAX_SEQ_LEN

F16 = np.float16


def arr(*shape, dtype=F16):
    return np.zeros(shape, dtype=dtype)


def good():
    return arr(2, 4, 33, 64), arr(2, 4, 33, 64), arr(2, 4, 33, 64)


def replace_arg(index, value):
    args = list(good())
    args[index] = value
    return args


def strided_last_dim():
    base = arr(2, 4, 33, 128)
    return base[..., ::2]


def huge(B, H, N, D=64):
    """A [B, H, N, D] fp16 array of any length that takes 128 bytes (one row, broadcast)."""
    return np.broadcast_to(arr(1, 1, 1, D), (B, H, N, D))


def read_only(x):
    x.setflags(write=False)
    return x


def zero_stride_out():
    """A writable out whose sequence stride is 0: every query row would land on the same bytes."""
    base = arr(2, 4, 1, 64)
    return np.lib.stride_tricks.as_strided(base, (2, 4, 33, 64), (base.strides[0], base.strides[1], 0, 2),
                                           writeable=True)


def interleaved_out():
    """A writable out whose heads overlap (head stride 32 elements for rows of 64)."""
    base = arr(2 * 4 * 33 * 64)
    return np.lib.stride_tricks.as_strided(base, (2, 4, 33, 64), (4 * 33 * 64 * 2, 64, 4 * 64 * 2, 2),
                                           writeable=True)


QKV_BUFFER = arr(2, 33, 4, 4, 64)  # [B, N, (q, k, v, spare), H, D]: views of one packed buffer


def packed(slot):
    return QKV_BUFFER[:, :, slot].transpose(0, 2, 1, 3)


BAD_CALLS = [
    pytest.param(replace_arg(0, arr(4, 33, 64)), {}, ArgumentError, "q must be 4-D", id="q-ndim"),
    pytest.param(replace_arg(1, arr(2, 4, 33, 64, dtype=np.float32)), {}, ArgumentError, "k must be float16", id="k-dtype"),
    pytest.param(replace_arg(2, arr(2, 4, 33, 64, dtype=np.int8)), {}, ArgumentError, "v must be float16", id="v-dtype"),
    pytest.param(replace_arg(0, arr(2, 4, 33, 64, dtype=omnicupy.arrays.BFLOAT16)), {}, ArgumentError, "share one dtype", id="mixed-dtypes"),
    pytest.param(replace_arg(0, arr(2, 4, 33, 48)), {}, ArgumentError, "head_dim", id="q-head-dim"),
    pytest.param(replace_arg(1, arr(2, 4, 33, 32)), {}, ArgumentError, "k and v must have the same shape", id="kv-shape"),
    pytest.param(replace_arg(0, arr(3, 4, 33, 64)), {}, ArgumentError, "batch", id="batch-mismatch"),
    pytest.param(replace_arg(0, arr(2, 6, 33, 64)), {}, ArgumentError, "multiple of k/v heads", id="heads-not-multiple"),
    pytest.param(replace_arg(0, arr(2, 4, 0, 64)), {}, ArgumentError, "zero-size", id="q-empty"),
    pytest.param(replace_arg(0, strided_last_dim()), {}, ArgumentError, "contiguous in its last dim", id="q-last-dim-strided"),
    pytest.param(replace_arg(0, [[1.0]]), {}, ArgumentError, "q must be a NumPy/CuPy array", id="q-list"),
    pytest.param(replace_arg(1, None), {}, ArgumentError, "k is required", id="k-none"),
    pytest.param(good(), {"scale": 0.0}, ArgumentError, "scale", id="scale-zero"),
    pytest.param(good(), {"scale": float("nan")}, ArgumentError, "scale", id="scale-nan"),
    pytest.param(good(), {"scale": "big"}, ArgumentError, "scale", id="scale-str"),
    pytest.param(good(), {"stages": 3}, ArgumentError, "stages", id="stages-3"),
    pytest.param(good(), {"causal": "yes"}, ArgumentError, "causal", id="causal-str"),
    pytest.param(good(), {"causal": True, "block_mask": BlockMask.full(33, 33)}, ArgumentError, "either block_mask", id="mask-and-causal"),
    pytest.param(good(), {"block_mask": np.ones((33, 33), bool)}, ArgumentError, "omnicupy.BlockMask", id="mask-not-blockmask"),
    pytest.param(good(), {"block_mask": BlockMask.full(32, 33)}, MaskError, "q_len=32", id="mask-q-len"),
    pytest.param(good(), {"block_mask": BlockMask.full(33, 40)}, MaskError, "kv_len=40", id="mask-kv-len"),
    pytest.param(good(), {"block_mask": BlockMask.from_block_types(np.full((3, 1, 1, 1), 2), q_len=33, kv_len=33)},
                 MaskError, "batch dim", id="mask-batch"),
    pytest.param(good(), {"block_mask": BlockMask.from_block_types(np.full((1, 3, 1, 1), 2), q_len=33, kv_len=33)},
                 MaskError, "head dim", id="mask-heads"),
    pytest.param(good(), {"out": arr(2, 4, 33, 32)}, ArgumentError, "out must have shape", id="out-shape"),
    pytest.param(good(), {"out": arr(2, 4, 33, 64, dtype=np.float32)}, ArgumentError, "out must have shape", id="out-dtype"),
    pytest.param(good(), {"out": arr(2, 4, 33, 128)[..., ::2]}, ArgumentError, "out must be contiguous", id="out-strided"),
    # scalars, checked as the kernel holds them (float32, and scale * log2(e) too)
    pytest.param(good(), {"scale": True}, ArgumentError, "scale must be a real number", id="scale-bool"),
    pytest.param(good(), {"scale": "0.5"}, ArgumentError, "scale must be a real number", id="scale-numeric-str"),
    pytest.param(good(), {"scale": 0.5 + 0j}, ArgumentError, "scale must be a real number", id="scale-complex"),
    pytest.param(good(), {"scale": np.array(0.5)}, ArgumentError, "scale must be a real number", id="scale-array"),
    pytest.param(good(), {"scale": -0.1}, ArgumentError, "positive", id="scale-negative"),
    pytest.param(good(), {"scale": float("inf")}, ArgumentError, "finite", id="scale-inf"),
    pytest.param(good(), {"scale": 1e300}, ArgumentError, "float32", id="scale-overflows-float32"),
    pytest.param(good(), {"scale": 3e38}, ArgumentError, "scale must be <=", id="scale-times-log2e-overflows"),
    pytest.param(good(), {"scale": 1e-50}, ArgumentError, "float32", id="scale-underflows-float32"),
    pytest.param(good(), {"scale": 10**400}, ArgumentError, "finite", id="scale-int-beyond-float64"),
    pytest.param(good(), {"stages": True}, ArgumentError, "stages", id="stages-bool"),
    pytest.param(good(), {"stages": 2.0}, ArgumentError, "stages", id="stages-float"),
    # out: writable, its own memory, none of the inputs'
    pytest.param(good(), {"out": read_only(arr(2, 4, 33, 64))}, AliasError, "read-only", id="out-read-only"),
    pytest.param(good(), {"out": zero_stride_out()}, AliasError, "overlapping elements", id="out-zero-stride"),
    pytest.param(good(), {"out": interleaved_out()}, AliasError, "overlapping elements", id="out-self-overlap"),
    pytest.param([packed(0), packed(1), packed(2)], {"out": packed(1)}, AliasError, "out shares memory with k",
                 id="out-is-k"),
    pytest.param([packed(0), packed(1), packed(2)], {"out": QKV_BUFFER[:, :, 0].transpose(0, 2, 1, 3)}, AliasError,
                 "out shares memory with q", id="out-aliases-q"),
    # sizes the kernels cannot index: refused before any copy to the device
    pytest.param([huge(1, 1, 2**31), huge(1, 1, 16), huge(1, 1, 16)], {}, SizeLimitError, "q: sequence length",
                 id="q-len-2**31"),
    pytest.param([huge(1, 1, 16), huge(1, 1, MAX_SEQ_LEN + 1), huge(1, 1, MAX_SEQ_LEN + 1)], {}, SizeLimitError,
                 "k/v: sequence length", id="kv-len-past-limit"),
    pytest.param([huge(65536, 1, 16), huge(65536, 1, 16), huge(65536, 1, 16)], {}, SizeLimitError, "batch",
                 id="batch-past-grid"),
]


@pytest.mark.parametrize("args,kwargs,error,message", BAD_CALLS)
def test_bad_call_raises_before_launch(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        omnicupy.attention(*args, **kwargs)


@pytest.mark.parametrize("args,kwargs", [
    pytest.param(good(), dict(causal=True), id="causal"),
    pytest.param(good(), dict(scale=np.float32(0.25), stages=np.int64(1)), id="numpy-scalars"),
    pytest.param(good(), dict(scale=2), id="int-scale"),
    pytest.param(good(), dict(out=arr(2, 4, 33, 64)), id="out"),
    pytest.param(good(), dict(out=arr(2, 4, 33, 128)[..., :64]), id="out-strided-rows"),
    pytest.param([packed(0), packed(1), packed(2)], dict(out=packed(3)), id="out-in-a-packed-buffer"),
    pytest.param([packed(0), packed(1), packed(1)], dict(out=packed(2)), id="k-is-v"),
    pytest.param([huge(1, 1, 16), huge(1, 1, 16), huge(1, 1, 16)], dict(out=arr(1, 1, 16, 64)), id="broadcast-inputs"),
])
def test_good_call_reaches_the_gpu_check(args, kwargs):
    """With valid arguments the only complaint on a CPU machine is the missing GPU."""
    if omnicupy.arrays.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(omnicupy.NoGPUError, match="GPU"):
        omnicupy.attention(*args, **kwargs)


def test_low_level_call_rejects_host_arrays():
    q, k, v = good()
    bm = BlockMask.full(33, 33)
    with pytest.raises(ArgumentError, match="device array"):
        omnicupy.omni_attn_mma_blockmask(q, k, v, arr(2, 4, 33, 64), bm.kv_num_blocks, bm.kv_indices,
                                         bm.block_mask_types)
