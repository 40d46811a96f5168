"""Fused expressions and kernel features on the CPU: validation, rendering and NVRTC compilation."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import ArgumentError, CompileError, score_mods
from omnicupy.errors import ExpressionError
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
    """Unknown names no longer reach NVRTC (test_expression_grammar.py); an expression the grammar
    allows but the compiler rejects (a wrong argument count) still gives the NVRTC log."""
    bad = CudaExpr.make("fminf(q_idx) > 0", kind="mask")
    with pytest.raises(CompileError, match="fminf"):
        build(Variant(64, "fp16", 128, 64, 4, 2, partial=True, mask_expr=bad.key), "sm_90", cache=cache)


@pytest.mark.parametrize("text,constants,arrays_,message", [
    pytest.param("", None, None, "non-empty", id="empty"),
    pytest.param("   ", None, None, "non-empty", id="blank"),
    pytest.param(None, None, None, "non-empty", id="not-a-string"),
    pytest.param("q_idx >= kv_idx; return 0", None, None, "';' at offset 15 is not allowed", id="semicolon"),
    pytest.param("q_idx >= kv_idx", {"q_idx": 1}, None, "not a usable C identifier", id="index-name"),
    pytest.param("q_idx >= kv_idx", {"kWindow": 1}, None, "not a usable C identifier", id="kName"),
    pytest.param("q_idx >= kv_idx", {"min": 1}, None, "not a usable C identifier", id="function-name"),
    pytest.param("q_idx >= kv_idx", {"asm": 1}, None, "not a usable C identifier", id="keyword"),
    pytest.param("q_idx >= kv_idx", {"bitand": 1}, None, "not a usable C identifier", id="alternative-token"),
    pytest.param("q_idx >= kv_idx", {"omni": 1}, None, "not a usable C identifier", id="namespace-name"),
    pytest.param("q_idx >= kv_idx", {"a__b": 1}, None, "not a usable C identifier", id="double-underscore"),
    pytest.param("q_idx >= kv_idx", {"_W": 1}, None, "not a usable C identifier", id="underscore-upper"),
    pytest.param("q_idx >= kv_idx", {"W-1": 1}, None, "not a usable C identifier", id="not-identifier"),
    pytest.param("q_idx >= kv_idx", {"W": "x"}, None, "int, float or bool", id="string-constant"),
    pytest.param("q_idx >= kv_idx", {"W": None}, None, "int, float or bool", id="none-constant"),
    pytest.param("q_idx >= kv_idx", {"W": 2**40}, None, "32-bit", id="int-too-big"),
    pytest.param("q_idx >= kv_idx", {"W": -2**31 - 1}, None, "32-bit", id="int-too-small"),
    pytest.param("q_idx >= kv_idx", {"W": np.uint64(2**33)}, None, "32-bit", id="numpy-uint64"),
    pytest.param("q_idx >= kv_idx", {"W": 1e300}, None, "finite in float32", id="float-overflows-float32"),
    pytest.param("q_idx >= kv_idx", {"W": float("inf")}, None, "finite", id="float-inf"),
    pytest.param("q_idx >= kv_idx", {"W": float("nan")}, None, "finite", id="float-nan"),
    pytest.param("q_idx >= kv_idx", {"W": 1e-45}, None, "normal range", id="float-underflows"),
    pytest.param("q_idx >= kv_idx", {"W": 1}, {"W": np.zeros(3)}, "distinct", id="same-name"),
    pytest.param("q_idx >= kv_idx", [("W", 1)], None, "mapping", id="constants-not-mapping"),
])
def test_expression_validation(text, constants, arrays_, message):
    with pytest.raises(ExpressionError, match=message):
        CudaExpr.make(text, constants, arrays_)


@pytest.mark.parametrize("value,ctype", [
    pytest.param(True, "bool", id="bool"), pytest.param(np.bool_(False), "bool", id="numpy-bool"),
    pytest.param(7, "int", id="int"), pytest.param(np.int64(-2**31), "int", id="int-min"),
    pytest.param(0.1, "float", id="float"), pytest.param(np.float32(3.5), "float", id="float32"),
    pytest.param(3.4e38, "float", id="float-near-max"), pytest.param(0.0, "float", id="zero"),
    pytest.param(-1.2e-38, "float", id="float-near-tiny"),
])
def test_constant_literals_are_exact(value, ctype):
    """A float constant's literal is the shortest decimal of its float32 value: the kernel reads
    exactly np.float32(value)."""
    (name, got_type, literal), = CudaExpr.make("q_idx > 0", {"C": value}).constants
    assert got_type == ctype
    if ctype == "float":
        assert literal.endswith("f") and np.float32(literal[:-1]) == np.float32(value)
    elif ctype == "int":
        assert int(literal) == value
    else:
        assert literal == ("true" if value else "false")


# ---------------------------------------------------------------- lookup arrays: dtype and copy
ARRAY_DTYPES = [
    pytest.param(np.arange(5, dtype=np.int32), "int", id="int32"),
    pytest.param(np.arange(5, dtype=np.int64), "int", id="int64-fits"),
    pytest.param(np.array([-2**31, 2**31 - 1], dtype=np.int64), "int", id="int64-extremes"),
    pytest.param(np.arange(5, dtype=np.uint8), "int", id="uint8"),
    pytest.param(np.array([2**31 - 1], dtype=np.uint32), "int", id="uint32-fits"),
    pytest.param(np.array([True, False]), "int", id="bool"),
    pytest.param(np.linspace(0, 1, 5, dtype=np.float32), "float", id="float32"),
    pytest.param(np.array([0.5, -2.0, 2.0**100, np.inf]), "float", id="float64-exact"),
    pytest.param(np.array([0.1], dtype=np.float32).astype(np.float64), "float", id="float64-from-float32"),
    pytest.param(np.array([0.1, 2.0], dtype=np.float16), "float", id="float16"),
    pytest.param(np.array([1.5], dtype=omnicupy.arrays.BFLOAT16), "float", id="bfloat16"),
    pytest.param([1, 2, 3], "int", id="list"),
]


@pytest.mark.parametrize("values,ctype", ARRAY_DTYPES)
def test_lookup_arrays_keep_their_values(values, ctype):
    expr = CudaExpr.make("t[q_idx] > 0", arrays_={"t": values})
    assert expr.array_decls == (("t", ctype),)
    stored, = expr.arrays
    assert stored.dtype == (np.int32 if ctype == "int" else np.float32) and stored.ndim == 1
    np.testing.assert_array_equal(stored.astype(np.float64), np.asarray(values).astype(np.float64))


BAD_ARRAYS = [
    pytest.param(np.array([2**32 + 1, 1], dtype=np.int64), "outside int32", id="int64-ids-beyond-32-bits"),
    pytest.param(np.array([-2**31 - 1], dtype=np.int64), "outside int32", id="int64-below"),
    pytest.param(np.array([2**31], dtype=np.uint32), "outside int32", id="uint32-above"),
    pytest.param(np.array([2**63], dtype=np.uint64), "outside int32", id="uint64"),
    pytest.param(np.array([0.1, 0.5]), "float32 would round", id="float64-inexact"),
    pytest.param(np.array([1e300]), "float32 would round", id="float64-overflow"),
    pytest.param(np.array([1 + 2j]), "ints, bools or floats", id="complex"),
    pytest.param(np.array(["a"]), "ints, bools or floats", id="strings"),
    pytest.param(np.array([object()]), "ints, bools or floats", id="objects"),
    pytest.param(np.zeros((2, 3), np.int32), "1-D", id="2-d"),
    pytest.param(np.int32(4), "1-D", id="scalar"),
    pytest.param(np.zeros(0, np.int32), "between 1 and", id="empty"),
]


@pytest.mark.parametrize("values,message", BAD_ARRAYS)
def test_lookup_arrays_that_would_change_are_refused(values, message):
    with pytest.raises(ExpressionError, match=message):
        CudaExpr.make("t[q_idx] > 0", arrays_={"t": values})


def test_int64_document_ids_no_longer_merge():
    """Issue 17: ids 2**32 + 1 and 1 became equal after a silent int32 cast (documents merged)."""
    with pytest.raises(ExpressionError, match="doc"):
        cuda_mask("doc[q_idx] == doc[kv_idx]", arrays={"doc": np.array([2**32 + 1, 1, 1], np.int64)})


def test_lookup_arrays_are_copied_and_frozen():
    doc = np.zeros(4, np.int64)
    expr = CudaExpr.make("doc[q_idx] == doc[kv_idx]", arrays_={"doc": doc})
    doc[:] = 2**40  # later changes to the caller's array are not seen (nor validated)
    stored, = expr.arrays
    np.testing.assert_array_equal(stored, 0)
    assert not stored.flags.writeable


# ---------------------------------------------------------------- lookup arrays: lengths
SIZES = dict(q_len=300, kv_len=500, heads=4, batch=2)
NEEDS = [
    pytest.param("t[q_idx] > 0", None, {"t": 300}, id="q_idx"),
    pytest.param("t[kv_idx] > 0", None, {"t": 500}, id="kv_idx"),
    pytest.param("t[q_idx] == t[kv_idx]", None, {"t": 500}, id="both"),
    pytest.param("t[h] > 0", None, {"t": 4}, id="heads"),
    pytest.param("t[b] > 0", None, {"t": 2}, id="batch"),
    pytest.param("t[max(q_idx - 1, 0)] > 0", None, {"t": 300}, id="computed-below-its-axis"),
    pytest.param("t[(h)] > 0", None, {"t": 4}, id="parenthesized-is-its-axis"),
    pytest.param("t[h % 3] > 0", {"t": 3}, {"t": 3}, id="computed-declared-count"),
    pytest.param("t[q_idx / 2] > 0", {"t": "q_idx"}, {"t": 300}, id="computed-declared-axis"),
    pytest.param("t[h] > 0 && t[q_idx % 2] > 0", {"t": 2}, {"t": 4}, id="mixed-bare-and-declared"),
    pytest.param("u[t[q_idx]] > 0", {"u": 7}, {"t": 300, "u": 7}, id="nested"),
    pytest.param("q_idx > 0", None, {}, id="unused-array-needs-nothing"),
]


@pytest.mark.parametrize("text,extents,want", NEEDS)
def test_required_lengths_follow_the_subscripts(text, extents, want):
    arrays_ = {"t": np.zeros(1000, np.int32), "u": np.zeros(1000, np.int32)}
    expr = CudaExpr.make(text, arrays_=arrays_, extents=extents)
    assert expr.required_lengths(**SIZES) == want
    expr.check_lengths(**SIZES)  # 1000 elements cover all of these
    for name, need in want.items():
        short = dict(arrays_, **{name: np.zeros(need - 1, np.int32)}) if need > 1 else None
        if short is None:
            continue
        if extents and isinstance(extents.get(name), int) and extents[name] > need - 1:
            with pytest.raises(ExpressionError, match="declared extent"):
                CudaExpr.make(text, arrays_=short, extents=extents)
            continue
        with pytest.raises(ExpressionError, match=f"array '{name}' .* has {need - 1} elements"):
            CudaExpr.make(text, arrays_=short, extents=extents).check_lengths(**SIZES)


def test_issue_table_of_four_indexed_up_to_255_is_refused():
    """Issue 17: a 4-element table read at q_idx up to 255 was accepted (out-of-bounds reads)."""
    from omnicupy.ops.inputs import check_expression_arrays

    expr = cuda_mask("t[q_idx] > 0", arrays={"t": np.ones(4, np.int32)}).cuda
    with pytest.raises(ExpressionError, match="up to 255"):
        check_expression_arrays(expr, 256, 256, 1, 1)
    check_expression_arrays(expr, 4, 256, 1, 1)
    check_expression_arrays(None, 256, 256, 1, 1)


@pytest.mark.parametrize("extents,message", [
    pytest.param({"nope": 3}, "not one of the expression's arrays", id="unknown-array"),
    pytest.param({"t": "n"}, "must be one of", id="unknown-axis"),
    pytest.param({"t": 0}, "positive int", id="zero"),
    pytest.param({"t": True}, "positive int", id="bool"),
    pytest.param({"t": 2.5}, "positive int", id="float"),
    pytest.param({"t": 11}, "declared extent is 11", id="longer-than-the-array"),
])
def test_bad_extents(extents, message):
    with pytest.raises(ExpressionError, match=message):
        CudaExpr.make("t[q_idx % 2] > 0", arrays_={"t": np.zeros(10, np.int32)}, extents=extents)


def test_elementwise_index_ranges_are_checked_before_a_launch():
    """The builders' elementwise evaluation checks the index arrays it is given (host arrays here)."""
    from omnicupy.mask.expressions import check_index_ranges

    expr = CudaExpr.make("t[q_idx] == t[kv_idx]", arrays_={"t": np.zeros(10, np.int32)}, kind="mask")
    zero = np.zeros((1, 1, 1, 1), np.int32)
    check_index_ranges(expr, zero, zero, np.arange(10)[:, None], np.arange(10)[None, :])
    with pytest.raises(ExpressionError, match="up to 10"):
        check_index_ranges(expr, zero, zero, np.arange(11)[:, None], np.arange(10)[None, :])
    with pytest.raises(ExpressionError, match="negative"):
        check_index_ranges(expr, zero, zero, np.arange(-1, 5)[:, None], np.arange(10)[None, :])


def test_fused_expressions_fit_the_kernel_slots():
    from omnicupy.dispatch.params import MAX_USER_ARRAYS
    from omnicupy.ops.inputs import check_expressions, check_qkv

    inp = check_qkv(*(np.zeros((1, 2, 16, 64), np.float16) for _ in range(3)))
    names = [f"a{i}" for i in range(MAX_USER_ARRAYS + 1)]
    text = " + ".join(f"{n}[h]" for n in names)
    many = CudaExpr.make(text, arrays_={n: np.zeros(2, np.float32) for n in names})
    with pytest.raises(ExpressionError, match="slots"):
        check_expressions([None, many], inp)
    few = CudaExpr.make("a0[h] > 0", arrays_={"a0": np.zeros(1, np.int32)}, kind="mask")
    with pytest.raises(ExpressionError, match="has 1 elements"):
        check_expressions([few, None], inp)


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
    pytest.param(lambda: score_mods.softcap(0.0), "positive", id="softcap-zero"),
    pytest.param(lambda: score_mods.softcap(-1.0), "positive", id="softcap-negative"),
    pytest.param(lambda: score_mods.softcap("30"), "real number", id="softcap-string"),
    pytest.param(lambda: score_mods.softcap(True), "real number", id="softcap-bool"),
    pytest.param(lambda: score_mods.softcap(float("inf")), "finite", id="softcap-inf"),
    pytest.param(lambda: score_mods.softcap(1e39), "float32", id="softcap-beyond-float32"),
    pytest.param(lambda: score_mods.softcap(1e-40), "float32", id="softcap-subnormal"),
    pytest.param(lambda: score_mods.softcap(1e38), "<=", id="softcap-inverse-underflows"),
    pytest.param(lambda: score_mods.alibi(0), "positive int", id="alibi-zero"),
    pytest.param(lambda: score_mods.alibi(True), "positive int", id="alibi-bool"),
    pytest.param(lambda: score_mods.alibi(4.0), "positive int", id="alibi-float"),
    pytest.param(lambda: score_mods.alibi(2**31), "positive int", id="alibi-huge"),
    pytest.param(lambda: omnicupy.cuda_score("score + t[h]", arrays={"t": np.array([0.1])}), "round",
                 id="cuda-score-inexact-array"),
    pytest.param(lambda: omnicupy.cuda_score("score + t[h % 2]", arrays={"t": np.ones(1, np.float32)},
                                             extents={"t": 2}), "declared extent", id="cuda-score-extent"),
])
def test_score_mod_argument_errors(factory, message):
    with pytest.raises(ArgumentError, match=message):
        factory()


def test_check_key_accepts_what_make_writes_and_nothing_else():
    """For the renderer (dispatch/variant.py): a key not made by CudaExpr.make is refused."""
    from omnicupy.mask.expressions import check_key

    made = CudaExpr.make("doc[q_idx] == doc[kv_idx] && q_idx - kv_idx < W && S > 0.5f && F",
                         {"W": 7, "S": 0.1, "F": True}, {"doc": np.zeros(3, np.int32)}, kind="mask")
    assert check_key(made.key, kind="mask") == made.key
    for key in (score_mods.softcap(30.0).cuda.key, score_mods.alibi(8).cuda.key):
        check_key(key)
    text, consts, decls = made.key
    forged = [
        ('q_idx >= kv_idx; } extern "C" __global__ void evil() {', consts, decls),
        (text, (("W", "int", "7; } void evil() {"),) + consts[1:], decls),
        (text, (("W", "int", "07"),) + consts[1:], decls),
        (text, tuple(c if c[0] != "S" else ("S", "float", "0.1f") for c in consts), decls),
        (text, tuple(c if c[0] != "F" else ("F", "bool", "1") for c in consts), decls),
        (text, tuple(c if c[0] != "S" else ("S", "double", "1.0e-01") for c in consts), decls),
        (text, consts, (("doc", "long"),)),
        (text, consts, (("doc; int x", "int"),)),
        ("score > 0", (), ()),
        ("just text",),
        None,
    ]
    for key in forged:
        with pytest.raises(ExpressionError):
            check_key(key, kind="mask")
