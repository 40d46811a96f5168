"""Fused expressions and kernel features on the CPU: validation, rendering and NVRTC compilation."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, CompileError, score_mods
from omnicupy.mask.expressions import CudaExpr, cuda_mask, fused_mask_expr, merge_names
from omnicupy.jit import build
from omnicupy.jit.cache import DiskCache
from omnicupy.dispatch.variant import Variant

DOC = CudaExpr.make("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", arrays_={"doc": np.zeros(8, np.int64)})

FEATURES = [
    pytest.param(dict(bias="fp16"), id="bias-fp16"),
    pytest.param(dict(bias="bf16"), id="bias-bf16"),
    pytest.param(dict(bias="fp32", causal=True, partial=True), id="bias-fp32-blocks"),
    pytest.param(dict(score_expr=score_mods.alibi(16).cuda.key), id="alibi"),
    pytest.param(dict(score_expr=score_mods.softcap(30.0).cuda.key, causal=True), id="softcap"),
    pytest.param(dict(partial=True, mask_expr=DOC.key), id="fused-document"),
    pytest.param(dict(partial=True, causal=True, bias="fp32", mask_expr=DOC.key,
                      score_expr=score_mods.softcap(5.0).cuda.key), id="everything"),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("feature-cache"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("features", FEATURES)
def test_feature_variants_compile(features, stages, arch, cache):
    variant = omnicupy.dispatch.tiles.select_variant(64, "bf16", stages, 128, 128, features.pop("causal", False),
                                            features.pop("partial", False), **features)
    entry, _ = build(variant, arch, cache=cache)
    assert entry.meta["kernel"] == variant.name


def test_expression_is_part_of_the_key():
    a = Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=CudaExpr.make("q_idx >= kv_idx").key)
    b = Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=CudaExpr.make("q_idx > kv_idx").key)
    c = Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=CudaExpr.make("q_idx >= kv_idx").key)
    assert a.name != b.name and a.name == c.name
    w1 = CudaExpr.make("q_idx - kv_idx < W", {"W": 1}).key
    w2 = CudaExpr.make("q_idx - kv_idx < W", {"W": 2}).key
    assert Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=w1).name != \
        Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=w2).name


def test_bad_expression_raises_compile_error_with_the_text(cache):
    bad = CudaExpr.make("q_idx >= undefined_name")
    with pytest.raises(CompileError, match="undefined_name"):
        build(Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=bad.key), "sm_90", cache=cache)


@pytest.mark.parametrize("text,constants,arrays_,message", [
    ("", None, None, "non-empty"),
    ("q_idx >= kv_idx; return 0", None, None, "single expression"),
    ("q_idx >= kv_idx", {"q_idx": 1}, None, "not a usable C identifier"),
    ("q_idx >= kv_idx", {"kWindow": 1}, None, "not a usable C identifier"),
    ("q_idx >= kv_idx", {"W": "x"}, None, "int, float or bool"),
    ("q_idx >= kv_idx", {"W": 2**40}, None, "32-bit"),
    ("q_idx >= kv_idx", {"W": 1}, {"W": np.zeros(3)}, "distinct"),
])
def test_expression_validation(text, constants, arrays_, message):
    with pytest.raises(ArgumentError, match=message):
        CudaExpr.make(text, constants, arrays_)


def test_merge_names_rejects_conflicts():
    merge_names(CudaExpr.make("W > 0", {"W": 1}), CudaExpr.make("score * W", {"W": 1}))
    with pytest.raises(ArgumentError, match="differently"):
        merge_names(CudaExpr.make("W > 0", {"W": 1}), CudaExpr.make("score * W", {"W": 2}))


def test_fused_mask_expr_sources():
    assert fused_mask_expr(omnicupy.masks.sliding_window(64)).text.startswith("q_idx >= kv_idx")
    cm = cuda_mask("q_idx >= kv_idx", numpy_fn=lambda b, h, q, k: q >= k)
    assert fused_mask_expr(cm) is cm.cuda
    assert fused_mask_expr(lambda b, h, q, k: q >= k) is None


def test_cuda_mask_numpy_form_builds_a_block_mask():
    cm = cuda_mask("q_idx >= kv_idx && q_idx - kv_idx < W", {"W": 50},
                   numpy_fn=lambda b, h, q, k: (q >= k) & (q - k < 50))
    if omnicupy.arrays.gpu_available():
        pytest.skip("on a GPU the builder evaluates the CUDA form (see the GPU tests)")
    bm = omnicupy.BlockMask.from_mask_mod(cm, None, None, 300, 300, q_block_size=64, kv_block_size=64)
    qi, ki = np.arange(300)[:, None], np.arange(300)[None, :]
    np.testing.assert_array_equal(bm.to_dense()[0, 0], (qi >= ki) & (qi - ki < 50))


def arr(*shape, dtype=np.float16):
    return np.zeros(shape, dtype=dtype)


QKV = (arr(2, 4, 33, 64), arr(2, 2, 40, 64), arr(2, 2, 40, 64))


@pytest.mark.parametrize("kwargs,message", [
    (dict(bias=arr(2, 4, 33, 41)), "does not broadcast"),
    (dict(bias=arr(2, 4, 40, dtype=np.int32)), "float16, bfloat16 or float32"),
    (dict(bias=arr(3, 4, 40)), "does not broadcast"),
    (dict(bias=arr(40)), r"\[B\|1, H\|1, Nkv\]"),
    (dict(score_mod=lambda s, b, h, q, k: s), "omnicupy.score_mods"),
    (dict(causal="bottom_left"), "bottom_right"),
])
def test_feature_argument_errors(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        omnicupy.attention(*QKV, **kwargs)


@pytest.mark.parametrize("factory,message", [
    (lambda: score_mods.softcap(0.0), "positive"),
    (lambda: score_mods.alibi(0), "positive int"),
])
def test_score_mod_argument_errors(factory, message):
    with pytest.raises(ArgumentError, match=message):
        factory()
