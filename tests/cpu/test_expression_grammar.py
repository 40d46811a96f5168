"""The allow-list grammar of CUDA expressions (omnicupy/mask/expr_syntax.py), on the CPU.

Attacks from issue 17 and their relatives are refused with an ExpressionError naming the token;
every expression the library itself writes, and the documented forms, are accepted; the functions
and casts the grammar allows really compile with NVRTC.
"""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import score_mods
from omnicupy.errors import ArgumentError, ExpressionError
from omnicupy.jit import build
from omnicupy.jit.cache import DiskCache
from omnicupy.dispatch.variant import Variant
from omnicupy.mask import expr_syntax
from omnicupy.mask.expressions import CudaExpr, cuda_mask, fused_mask_expr

from mask_cases import MASK_CASES

DOC = np.arange(8)

# (expression, the token the error must name); arrays: doc; constants: W.
ATTACKS = [
    pytest.param('%:include "/etc/passwd"', "%:", id="digraph-include"),
    pytest.param('q_idx >= kv_idx\n#include "/etc/passwd"', "\n", id="newline-include"),
    pytest.param("%:define q_idx 0\nq_idx", "%:", id="digraph-define"),
    pytest.param("%:%:", "%:%:", id="digraph-paste"),
    pytest.param('true %> %> extern "C" __global__ void evil(int* p) <% p[0] = 1; %> namespace <% bool f() <% return 1',
                 "%>", id="close-namespace-digraphs"),
    pytest.param('0); } extern "C" __global__ void evil() { (0', ";", id="close-function"),
    pytest.param("q_idx >= kv_idx <% 0 %>", "<%", id="digraph-brace"),
    pytest.param("doc<:q_idx:> == 0", "<:", id="digraph-bracket"),
    pytest.param("doc[q_idx :> == 0", ":>", id="digraph-bracket-close"),
    pytest.param("??=define X 1", "??", id="trigraph"),
    pytest.param("q_idx >= kv_idx /* c */", "/*", id="block-comment"),
    pytest.param("q_idx >= kv_idx // c", "//", id="line-comment"),
    pytest.param("q_idx \\\n>= kv_idx", "\\", id="backslash"),
    pytest.param('q_idx >= "a"[0]', '"', id="string-literal"),
    pytest.param("q_idx >= 'a'", "'", id="char-literal"),
    pytest.param("q_idx >=\tkv_idx", "\t", id="tab"),
    pytest.param("q_idx >=\rkv_idx", "\r", id="carriage-return"),
    pytest.param("q_idx \x00>= kv_idx", "\x00", id="nul"),
    pytest.param("q_idx ≥ kv_idx", "≥", id="non-ascii"),
    pytest.param("q_idx >= kv_idx; return 0", ";", id="semicolon"),
    pytest.param("q_idx >= kv_idx }", "}", id="brace"),
    pytest.param('asm("trap;")', '"', id="asm-string"),
    pytest.param("asm(q_idx)", "asm", id="asm"),
    pytest.param("__syncthreads()", "__syncthreads", id="builtin-function"),
    pytest.param("printf(q_idx)", "printf", id="printf"),
    pytest.param("q_idx >= kv_idx && __LINE__", "__LINE__", id="macro-name"),
    pytest.param("_Pragma(q_idx)", "_Pragma", id="pragma-operator"),
    pytest.param("sizeof(q_idx) > 0", "sizeof", id="keyword-sizeof"),
    pytest.param("static_cast<int>(score)", "static_cast", id="keyword-cast"),
    pytest.param("std::exit(0)", "std::exit", id="qualified-name"),
    pytest.param("::abs(q_idx) > 0", "::", id="global-scope"),
    pytest.param("omni :: tanh_fast(score)", "::", id="spaced-scope"),
    pytest.param("kLn2 * score", "kLn2", id="kernel-constant"),
    pytest.param("q_tile_order[0] > 0", "q_tile_order", id="kernel-parameter"),
    pytest.param("score > 0", "score", id="score-in-mask"),
    pytest.param("q_idx = kv_idx", "=", id="assignment"),
    pytest.param("q_idx >>= 1", ">>=", id="compound-assignment"),
    pytest.param("q_idx++ > 0", "++", id="increment"),
    pytest.param("q_idx->x", "->", id="arrow"),
    pytest.param("q_idx.x", ".", id="member"),
    pytest.param("q_idx <=> kv_idx", "<=>", id="spaceship"),
    pytest.param("(q_idx, kv_idx) > 0", ",", id="comma-operator"),
    pytest.param("min(q_idx, kv_idx), 1", ",", id="comma-after-call"),
    pytest.param("min(q_idx ? 1, 2 : 3, 4)", ",", id="comma-inside-ternary"),
    pytest.param("doc > 0", "doc", id="array-as-pointer"),
    pytest.param("*(doc + 100000) > 0", "*", id="unary-deref"),
    pytest.param("(int)&doc[1] > 0", "&", id="address-after-cast"),
    pytest.param("q_idx > 0 && &doc[1] != 0", "&", id="address-of"),
    pytest.param("q_idx[doc] > 0", "[", id="index-swapped"),
    pytest.param("doc[q_idx][0] > 0", "[", id="double-index"),
    pytest.param("(doc)[q_idx] > 0", "doc", id="parenthesized-array"),
    pytest.param("[](){ return true; }()", "{", id="lambda"),
    pytest.param("[]() > 0", "[", id="lambda-head"),
    pytest.param("min > 0", "min", id="function-not-called"),
    pytest.param("int(q_idx) > 0", "int", id="functional-cast"),
    pytest.param("(unsigned)q_idx > 0", "unsigned", id="other-cast"),
    pytest.param("(long long)q_idx > 0", "long", id="long-cast"),
    pytest.param("q_idx >= kv_idx)", ")", id="unbalanced-close"),
    pytest.param("doc[q_idx) > 0", ")", id="mismatched-close"),
    pytest.param("q_idx ? kv_idx", "?", id="question-without-colon"),
    pytest.param("q_idx : kv_idx", ":", id="colon-without-question"),
    pytest.param("() > 0", ")", id="empty-parentheses"),
    pytest.param("0x10 > q_idx", "0x10", id="hex-literal"),
    pytest.param("010 > q_idx", "010", id="octal-literal"),
    pytest.param("1e999 > q_idx", "1e999", id="overflowing-literal"),
    pytest.param("1e39f > q_idx", "1e39f", id="overflowing-float-literal"),
    pytest.param("99999999999999999999 > q_idx", "99999999999999999999", id="huge-int-literal"),
    pytest.param("1.0.0 > q_idx", "1.0.0", id="bad-number"),
    pytest.param("1e+kv_idx > q_idx", "1e+kv_idx", id="pp-number-swallows-name"),
    pytest.param("1_km > q_idx", "1_km", id="user-defined-literal"),
    pytest.param("q_idx >= kv_idx $", "$", id="dollar"),
    pytest.param("q_idx >= kv_idx @", "@", id="at"),
    pytest.param("q_idx >= `kv_idx`", "`", id="backtick"),
]


@pytest.mark.parametrize("text,token", ATTACKS)
def test_attacks_are_refused_naming_the_token(text, token):
    with pytest.raises(ExpressionError) as info:
        CudaExpr.make(text, {"W": 3}, {"doc": DOC}, kind="mask")
    assert repr(token) in str(info.value) or repr(token).strip("'") in str(info.value), str(info.value)
    assert isinstance(info.value, ArgumentError)


def test_refused_at_construction():
    """cuda_mask / cuda_score refuse when they are made, long before any kernel is rendered."""
    with pytest.raises(ExpressionError):
        cuda_mask('%:include "/etc/passwd"')
    with pytest.raises(ExpressionError):
        omnicupy.cuda_score("score\n#define X")


ACCEPTED = [
    pytest.param("q_idx >= kv_idx", "mask", id="causal"),
    pytest.param("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", "mask", id="document"),
    pytest.param("q_idx >= kv_idx && q_idx - kv_idx < W", "mask", id="window-constant"),
    pytest.param("q_idx + (-5) >= kv_idx", "mask", id="negative-literal"),
    pytest.param("(q_idx - kv_idx) % 3 == 0 || !(q_idx < kv_idx)", "mask", id="modulo-not"),
    pytest.param("b == 0 ? true : q_idx >= kv_idx", "mask", id="ternary"),
    pytest.param("h < 2 ? (q_idx > 3 ? true : false) : kv_idx <= q_idx", "mask", id="nested-ternary"),
    pytest.param("(~q_idx & 1) == 0 && (q_idx ^ kv_idx) >> 2 != (1 << 3) | 2u", "mask", id="bitwise"),
    pytest.param("min(q_idx, kv_idx) > max(3, abs(h - b))", "mask", id="min-max-abs"),
    pytest.param("doc[doc[q_idx] % 8] >= 0", "mask", id="computed-index"),
    pytest.param("score * W + doc[h]", "score", id="score-array"),
    pytest.param("-score + .5f * (float)(kv_idx - q_idx) + 1e-3 + 2.5e+2f + 3.f", "score", id="float-literals"),
    pytest.param("(int)score > 0 ? (float)(bool)q_idx : score", "score", id="casts"),
    pytest.param("-(int)score * 2 + -(float)h", "score", id="unary-minus-after-cast"),
    pytest.param("omni::tanh_fast(score * 0.5f) * 2.0f", "score", id="tanh-fast"),
    pytest.param("fminf(fmaxf(score, -1.0f), 1.0f) + expf(logf(2.0f)) + exp2f(1.0f) * sqrtf(4.0f)", "score",
                 id="math"),
]


@pytest.mark.parametrize("text,kind", ACCEPTED)
def test_documented_forms_are_accepted(text, kind):
    expr = CudaExpr.make(text, {"W": 3}, {"doc": DOC}, kind=kind)
    assert expr.text == text


def _library_expressions():
    for case_id, factory in MASK_CASES:
        expr = fused_mask_expr(factory(300, 500))
        if expr is not None:
            yield pytest.param(expr, id=f"zoo-{case_id}")
    for offset in (-2**31, -7, 0, 9, 2**31 - 1):
        yield pytest.param(fused_mask_expr(omnicupy.masks.causal(offset)), id=f"causal-offset-{offset}")
    for mask in (omnicupy.masks.sliding_window(1), omnicupy.masks.local_window(0, 5), omnicupy.masks.prefix_lm(0),
                 omnicupy.masks.dilated_sliding_window(3, 4)):
        yield pytest.param(fused_mask_expr(mask), id=mask.name)
    for heads in (1, 16, 65535):
        yield pytest.param(score_mods.alibi(heads).cuda, id=f"alibi-{heads}")
    for cap in (1e-30, 0.5, 30.0, 1e30):
        yield pytest.param(score_mods.softcap(cap).cuda, id=f"softcap-{cap:g}")


@pytest.mark.parametrize("expr", list(_library_expressions()))
def test_every_library_expression_passes(expr):
    """The library's own expressions go through the same grammar (fused_mask_expr / the factories
    would raise otherwise); re-checking the text as given is a no-op."""
    assert isinstance(expr, CudaExpr)
    kind = "score" if "score" in expr.text else "mask"
    expr_syntax.check(expr.text, constants=[c[0] for c in expr.constants], arrays=[d[0] for d in expr.array_decls],
                      score=kind == "score")


def test_builtin_masks_with_expressions_are_covered():
    """Guard for the table above: at least the simple-rule masks carry expressions."""
    names = {fused_mask_expr(f(300, 500)).text.split()[0] for _, f in MASK_CASES if fused_mask_expr(f(300, 500))}
    assert names, "no built-in mask carries a CUDA expression any more"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return DiskCache(tmp_path_factory.mktemp("grammar-cache"))


def test_every_allowed_function_and_cast_compiles(cache):
    """Each function and cast the grammar allows exists for NVRTC (no includes) in a score modifier."""
    calls = {
        "min": "(float)min(q_idx, kv_idx)", "max": "(float)max(q_idx, kv_idx)", "abs": "(float)abs(h - b)",
        "omni::tanh_fast": "omni::tanh_fast(score)",
    }
    two_args = {"fminf", "fmaxf", "fmodf", "copysignf", "powf"}
    terms = [calls.get(f, f"{f}(score, 2.0f)" if f in two_args else f"{f}(score)")
             for f in sorted(expr_syntax.FUNCTIONS)]
    terms += ["(float)(int)score", "(float)(bool)q_idx", "(float)true"]
    expr = CudaExpr.make(" + ".join(terms), kind="score")
    build(Variant(64, "fp16", 128, 64, 4, 2, score_expr=expr.key), "sm_80", cache=cache)


def test_mask_kind_has_no_score_but_score_kind_has():
    CudaExpr.make("score > 0", kind="score")
    with pytest.raises(ExpressionError, match="no score"):
        cuda_mask("score > 0")
    with pytest.raises(ArgumentError, match="kind"):
        CudaExpr.make("q_idx > 0", kind="other")
