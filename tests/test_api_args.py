"""Bad input raises a clear error naming the argument, before any launch (checked on the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, BlockMask, MaskError

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
]


@pytest.mark.parametrize("args,kwargs,error,message", BAD_CALLS)
def test_bad_call_raises_before_launch(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        omnicupy.attention(*args, **kwargs)


def test_good_call_reaches_the_gpu_check():
    """With valid arguments the only complaint on a CPU machine is the missing GPU."""
    if omnicupy.arrays.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(omnicupy.NoGPUError, match="GPU"):
        omnicupy.attention(*good(), causal=True)


def test_low_level_call_rejects_host_arrays():
    q, k, v = good()
    bm = BlockMask.full(33, 33)
    with pytest.raises(ArgumentError, match="device array"):
        omnicupy.omni_attn_mma_blockmask(q, k, v, arr(2, 4, 33, 64), bm.kv_num_blocks, bm.kv_indices,
                                         bm.block_mask_types)
