"""compile_mask: what translates (each construct against the evaluated mask_mod), what is refused
(MaskError naming construct and line), closure values as kernel arguments (one key), the template
cache, 2-D tables and their limits, and BlockMask.from_mask_mod's use of it (and its fallback)."""
from __future__ import annotations

import functools
import logging
import operator
import types

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, MaskError, masks
from omnicupy.mask import builders, compile_mask as cm, compile_source

# Array modules under FlexAttention users' names: ``torch`` is a stand-in module (NumPy's functions
# under torch's module name), so the same source runs in Python and compiles.
torch = types.ModuleType("torch")
for _name in ("where", "minimum", "maximum", "abs", "logical_and", "logical_not", "remainder", "fmod", "clip",
              "floor_divide", "logical_or", "logical_xor", "bitwise_and", "bitwise_not", "ones_like", "zeros_like"):
    setattr(torch, _name, getattr(np, _name))
torch.clamp = lambda x, min=None, max=None: np.clip(x, min, max)
torch.bool = np.bool_
xp = np

DOC = np.repeat(np.arange(9), [5, 17, 1, 30, 8, 8, 40, 2, 9])  # 120 positions
DOC2 = np.stack([DOC, DOC[::-1]])                            # per-batch ids [2, 120]
FLAGS = (np.arange(120) % 3 == 0)
N_GLOBAL, WINDOW, BLOCK = 5, 17, 8
ZERO_D = np.array(6)  # a 0-d array (torch.tensor(6) alike) read as a number


def _grid(n_q=70, n_kv=90, q0=0, kv0=0, batch=2, heads=3):
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(heads).reshape(1, -1, 1, 1)
    q = np.arange(q0, q0 + n_q).reshape(1, 1, -1, 1)
    kv = np.arange(kv0, kv0 + n_kv).reshape(1, 1, 1, -1)
    return b, h, q, kv


def _scalar_reference(fn, b, h, q, kv):
    """FlexAttention's semantics: the mask_mod called with four Python ints per element."""
    shape = np.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
    out = np.empty(shape, dtype=bool)
    for i in np.ndindex(shape):
        out[i] = bool(fn(int(b.reshape(-1)[i[0] % b.size]), int(h.reshape(-1)[i[1] % h.size]),
                         int(q.reshape(-1)[i[2]]), int(kv.reshape(-1)[i[3]])))
    return out


def _agree(fn, scalar=False, **grid):
    compiled = omnicupy.compile_mask(fn)
    b, h, q, kv = _grid(**grid)
    shape = np.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
    want = _scalar_reference(fn, b, h, q, kv) if scalar else np.broadcast_to(fn(b, h, q, kv), shape)
    np.testing.assert_array_equal(np.broadcast_to(compiled(b, h, q, kv), shape), want)
    return compiled


def _helper_same_doc(i, j):
    return DOC[i] == DOC[j]


def _window_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def _with_default(b, h, q_idx, kv_idx, width=7):
    return abs(q_idx - kv_idx) <= width


def _nested(b, h, q_idx, kv_idx):
    def near(x, y):
        return xp.abs(x - y) < 9
    inner = lambda x: x // 4  # noqa: E731
    return near(inner(q_idx), inner(kv_idx)) | (kv_idx < N_GLOBAL)


_PREFIX_3 = masks.prefix_lm(3)


def _for_loop(b, h, q_idx, kv_idx):
    result = q_idx < 0
    for m in (_window_mask, _PREFIX_3):
        result = result | m(b, h, q_idx, kv_idx)
    return result


_INTERVALS = np.array([[0, 30], [20, 70], [50, 90], [85, 120]])
_IMAGE_OF_KV = np.repeat(np.arange(4), 30)


def _flamingo(b, h, q_idx, kv_idx):
    """attention-gym's Flamingo mask as written for flex's vmap (an interval row, then its items)."""
    interval = _INTERVALS[_IMAGE_OF_KV[kv_idx]]
    return (q_idx >= interval[0]) & (q_idx < interval[1])


# (id, mask_mod, compared with scalar calls) -- each row one construct
SUPPORTED = [
    ("chained_compare", lambda b, h, q, kv: (0 <= q - kv) & (q - kv < 11), False),
    ("python_chained", lambda b, h, q, kv: 0 <= q - kv < 11, True),
    ("floor_div_mod_negative", lambda b, h, q, kv: (q - kv) // 7 % 3 == (kv - 40) % -4 + 2, False),
    ("floor_div_by_closure", lambda b, h, q, kv: (q - 50) // BLOCK == (kv - 50) // BLOCK, False),
    ("torch_where_min_max", lambda b, h, q, kv: torch.where(q > 30, torch.minimum(q, kv) > 20,
                                                            torch.maximum(q, kv) < 40), False),
    ("np_abs_clip", lambda b, h, q, kv: np.clip(np.abs(q - kv), 2, 9) == 5, False),
    ("torch_clamp_kwargs", lambda b, h, q, kv: torch.clamp(q - kv, min=0) < 6, False),
    ("torch_remainder_fmod", lambda b, h, q, kv: torch.remainder(q - kv, 5) != torch.fmod(kv - q, 5), False),
    ("xp_logical", lambda b, h, q, kv: xp.logical_and(q >= kv, xp.logical_not(kv % 5 == 1)), False),
    ("bool_ops", lambda b, h, q, kv: ~((q < kv) ^ (h == 1)) | ((b == 1) & (kv == 3)), False),
    ("and_or_not", lambda b, h, q, kv: (q >= kv and not kv > 20) or h == 2, True),
    ("python_min_max_abs", lambda b, h, q, kv: min(q, 40) - max(kv, 10) >= abs(h - 1), True),
    ("doc_lookup", lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), False),
    ("bool_table", lambda b, h, q, kv: FLAGS[kv] | ~FLAGS[q], False),
    ("nested_lookup", lambda b, h, q, kv: DOC[DOC[q] * 3] <= DOC[kv], False),
    ("clamped_index", lambda b, h, q, kv: DOC[np.minimum(q + kv, 119)] == 3, False),
    ("per_batch_table", lambda b, h, q, kv: DOC2[b, q] == DOC2[b, kv], False),
    ("per_batch_table_chained", lambda b, h, q, kv: DOC2[b][q] == DOC2[b][kv], True),
    ("helper_function", lambda b, h, q, kv: _helper_same_doc(q, kv) & (q >= kv), False),
    ("mask_mod_call_shifted", lambda b, h, q, kv: _window_mask(b, h, q - 5, kv), False),
    ("default_argument", _with_default, False),
    ("nested_def_and_lambda", _nested, False),
    ("for_loop_over_masks", _for_loop, False),
    ("zoo_and_masks", masks.and_masks(masks.sliding_window(13), masks.document(DOC)), False),
    ("zoo_or_not", masks.or_masks(masks.not_mask(masks.local_window(3, 4)), masks.prefix_lm(9)), False),
    ("zoo_interleaved", masks.interleaved([("text", 30), ("image", 41), ("text", 49)]), False),
    ("zoo_dilated", masks.dilated_sliding_window(6, 3), False),
    ("reduce_operator", lambda b, h, q, kv: functools.reduce(operator.or_, (q == kv + d for d in (0, 3, 9))), False),
    ("constant_true", lambda b, h, q, kv: True, True),
    ("len_and_shape", lambda b, h, q, kv: (q < len(DOC) - 100) | (kv >= DOC.shape[0] - 10), False),
    ("zero_d_array_number", lambda b, h, q, kv: q - kv < ZERO_D, False),
    ("flamingo_vmap_style", _flamingo, True),
]


@pytest.mark.parametrize("fn, scalar", [pytest.param(f, s, id=i) for i, f, s in SUPPORTED])
def test_supported_construct_agrees(fn, scalar):
    compiled = _agree(fn, scalar, n_q=70, n_kv=90, q0=11, kv0=3)
    assert isinstance(compiled, omnicupy.mask.expressions.CudaMask)


def _exec_made():
    namespace: dict = {}
    exec("def f(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n", namespace)  # noqa: S102
    return namespace["f"]


def _branch(b, h, q_idx, kv_idx):
    if q_idx > 5:
        return kv_idx < 3
    return q_idx >= kv_idx


def _while(b, h, q_idx, kv_idx):
    while False:
        pass
    return q_idx >= kv_idx


REFUSED = [
    ("data_dependent_if", _branch, r"if statement on a traced value.*line \d+"),
    ("ifexp_traced", lambda b, h, q, kv: q if q > kv else kv, r"'x if cond else y'"),
    ("true_division", lambda b, h, q, kv: q / 2 > kv, r"true division"),
    ("float_constant", lambda b, h, q, kv: q * 0.5 > kv, r"float 0.5"),
    ("while_loop", _while, r"statement While \(line \d+\)"),
    ("no_source", _exec_made(), r"no source code"),
    ("c_callable", np.greater_equal, r"C callable|ufunc"),
    ("unknown_call", lambda b, h, q, kv: np.vectorize(lambda x: x)(q) > kv, r"array function vectorize"),
    ("returns_int", lambda b, h, q, kv: q - kv, r"returns ints"),
    ("index_sum_of_axes", lambda b, h, q, kv: DOC[q + kv] > 0, r"may reach .* past the 120 elements"),
    ("index_past_axis", lambda b, h, q, kv: DOC[q + 1] > 0, r"may reach"),
    ("index_negative", lambda b, h, q, kv: DOC[q - 1] > 0, r"may be negative"),
    ("divide_by_maybe_zero", lambda b, h, q, kv: q // kv > 1, r"may be 0 here"),
    ("overflow_everywhere", lambda b, h, q, kv: b * h * h * b * 1000 > q, r"can leave int32"),
    ("bool_arithmetic", lambda b, h, q, kv: (q > kv) + (q < 3) > 0, r"arithmetic '\+' on a boolean"),
    ("float_table", lambda b, h, q, kv: np.linspace(0, 1, 4)[q % 4] > 0, r"array function linspace"),
    ("slice", lambda b, h, q, kv: DOC[:3][q % 3] > 0, r"a slice"),
]


@pytest.mark.parametrize("fn, message", [pytest.param(f, m, id=i) for i, f, m in REFUSED])
def test_refused_with_mask_error(fn, message):
    with pytest.raises(MaskError, match=message):
        omnicupy.compile_mask(fn)


def _factory(prefix, window):
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | ((q_idx >= kv_idx) & (q_idx - kv_idx < window))
    return mask


def _docs_factory(ids):
    return lambda b, h, q, kv: ids[q] == ids[kv]


@pytest.mark.parametrize("make, first, second", [
    pytest.param(_factory, (4, 10), (64, 2048), id="numbers"),
    pytest.param(_docs_factory, (DOC,), (np.arange(500) // 7,), id="tables"),
    pytest.param(masks.sliding_window, (5,), (1024,), id="zoo_numbers"),
    pytest.param(lambda ids: masks.document(ids, causal=True), (DOC,), (np.arange(77) // 3,), id="zoo_tables"),
])
def test_closure_values_are_kernel_arguments(make, first, second):
    """Masks differing only in closure values: one translation, one CudaExpr key (one kernel)."""
    one, two = omnicupy.compile_mask(make(*first)), omnicupy.compile_mask(make(*second))
    assert one.cuda.key == two.cuda.key
    assert cm.template_for(make(*first)) is cm.template_for(make(*second))
    assert not all(np.array_equal(x, y) for x, y in zip(one.cuda.arrays, two.cuda.arrays))


def test_torch_idioms_translate():
    """torch's and_masks idiom: a boolean start from b.new_ones (b is a tensor there, not here)."""
    def torch_and(b, h, q_idx, kv_idx):
        result = b.new_ones((), dtype=torch.bool)
        for m in (_window_mask, _PREFIX_3):
            result = result & m(b, h, q_idx, kv_idx)
        return result

    assert omnicupy.compile_mask(torch_and).cuda.text == omnicupy.compile_mask(
        lambda b, h, q, kv: True & _window_mask(b, h, q, kv) & _PREFIX_3(b, h, q, kv)).cuda.text


def test_template_is_not_parsed_again(monkeypatch):
    omnicupy.compile_mask(_factory(1, 2))
    monkeypatch.setattr(compile_source, "_find", lambda *a: pytest.fail("parsed again"))
    monkeypatch.setattr(cm, "_translate", lambda *a: pytest.fail("translated again"))
    omnicupy.compile_mask(_factory(3, 4))


def test_inlined_functions_are_part_of_the_signature():
    """A combinator of other masks (the same code, other functions inside) is translated again."""
    first = omnicupy.compile_mask(masks.or_masks(masks.causal(), masks.causal()))
    second = omnicupy.compile_mask(masks.or_masks(masks.prefix_lm(2), masks.causal()))
    assert first.cuda.key != second.cuda.key
    _agree(masks.or_masks(masks.prefix_lm(2), masks.causal()))


def test_branch_on_closure_flag_keys_by_value():
    """A closure flag that picks a branch is part of the translation's signature."""
    causal, free = masks.document(DOC, causal=True), masks.document(DOC, causal=False)
    assert omnicupy.compile_mask(causal).cuda.key != omnicupy.compile_mask(free).cuda.key
    _agree(causal), _agree(free)


@pytest.mark.parametrize("fn, bad, good, why", [
    pytest.param(lambda b, h, q, kv: DOC2[b, q] == DOC2[b, kv], (3, 1, 100, 100), (2, 16, 120, 120), "along b",
                 id="2d-batch-rows"),
    pytest.param(lambda b, h, q, kv: DOC2[b, q] == DOC2[b, kv], (2, 1, 121, 100), (2, 1, 120, 120), "along q_idx",
                 id="2d-columns"),
    pytest.param(lambda b, h, q, kv: DOC[q // 2] == 1, (1, 1, 121, 1), (1, 1, 120, 5000), "along q_idx",
                 id="1d-computed"),
    pytest.param(lambda b, h, q, kv: DOC[q] == DOC[kv], (1, 1, 50, 121), (1, 1, 120, 120), "has 120 elements",
                 id="1d-plain"),
    pytest.param(lambda b, h, q, kv: q * 4096 < kv * 4096, (1, 1, 2**19 + 1, 8), (1, 1, 2**19, 2**19),
                 "sequences up to 524288", id="overflow-length"),
])
def test_sizes_past_what_it_was_compiled_for(fn, bad, good, why):
    compiled = omnicupy.compile_mask(fn)
    names = ("batch", "heads", "q_len", "kv_len")
    assert why in compiled.why_not(**dict(zip(names, bad)))
    with pytest.raises(MaskError, match=why):
        compiled.check_sizes(**dict(zip(names, bad)))
    assert compiled.why_not(**dict(zip(names, good))) is None


@pytest.mark.parametrize("xp_", [np, pytest.param("device", id="device-path")])
def test_from_mask_mod_uses_the_compiled_mask(xp_, monkeypatch):
    from mask_cases import HOST_AS_DEVICE

    fn = _factory(9, 33)
    used = []
    original = cm.for_build
    monkeypatch.setattr(cm, "for_build", lambda *a: used.append(original(*a)) or used[-1])
    kwargs = dict(q_block_size=32, kv_block_size=32, xp=HOST_AS_DEVICE if xp_ == "device" else np)
    bm = BlockMask.from_mask_mod(fn, 2, None, 300, 270, **kwargs)
    assert isinstance(used[0], cm.CompiledMask) and bm.mask_mod is fn
    monkeypatch.setattr(cm, "for_build", lambda *a: None)
    python = BlockMask.from_mask_mod(fn, 2, None, 300, 270, **kwargs)
    np.testing.assert_array_equal(bm.to_dense(), python.to_dense())
    assert bm.summary.counts == python.summary.counts


def test_fallback_is_logged_once(caplog):
    def data_dependent(b, h, q_idx, kv_idx):
        if q_idx > 5:
            return kv_idx < 3
        return q_idx >= kv_idx

    def vectorized(b, h, q_idx, kv_idx):
        return np.where(q_idx > 5, kv_idx < 3, q_idx >= kv_idx)

    with caplog.at_level(logging.INFO, logger="omnicupy.mask"):
        for _ in range(3):  # today's path: the scalar mode
            bm = builders.from_mask_mod(data_dependent, None, None, 64, 64, q_block_size=32, kv_block_size=32, xp=np)
            assert bm.mask_mod is data_dependent
    said = [r for r in caplog.records if "not compiled to CUDA" in r.getMessage()]
    assert len(said) == 1 and "if statement" in said[0].getMessage() and "line" in said[0].getMessage()
    assert cm.for_build(vectorized, 1, 1, 64, 64) is not None


# ------------------------------------------------------------- the hardening branch's index rule
def _index_rule_landed() -> bool:
    """Whether cuda_mask refuses an index that could leave its array (the hardening issue's rule,
    on another branch): these tests run once both branches are merged."""
    try:
        omnicupy.cuda_mask("t[q_idx + kv_idx] > 0", arrays={"t": np.ones(64, np.int32)})
    except omnicupy.mask.expressions.ExpressionError:
        return True
    return False


needs_index_rule = pytest.mark.skipif(not _index_rule_landed(), reason="needs the index rule of the hardening "
                                      "branch (issue 36); runs after the merge")


@needs_index_rule
@pytest.mark.parametrize("text, extents", [
    pytest.param("t[q_idx + kv_idx] > 0", None, id="sum-of-axes"),
    pytest.param("t[q_idx - kv_idx] > 0", None, id="difference"),
    pytest.param("t[q_idx + 1] > 0", {"t": "q_idx"}, id="past-its-extent"),
])
def test_index_rule_refuses_the_issue_cases(text, extents):
    with pytest.raises(omnicupy.mask.expressions.ExpressionError):
        omnicupy.cuda_mask(text, arrays={"t": np.ones(64, np.int32)}, extents=extents)


@needs_index_rule
@pytest.mark.parametrize("fn", [pytest.param(f, id=i) for i, f, _ in SUPPORTED])
def test_compiled_indices_pass_the_index_rule(fn):
    """Every index form the compiler writes (s_x[0], t[q_idx], t[q_idx / 4], t[min(.., n)], the 2-D
    t[b * cols + q_idx], nested lookups) is accepted by the rule: compile_mask makes its CudaExpr
    through CudaExpr.make, which applies it (a refusal is a MaskError here)."""
    assert omnicupy.compile_mask(fn).cuda.array_decls is not None


class _DLPackTable:
    """A table known only through DLPack (as a CPU torch tensor is): shape, dtype, __dlpack__."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values
        self.shape, self.dtype = values.shape, values.dtype

    def __dlpack__(self, **kwargs):
        return self._values.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._values.__dlpack_device__()


def test_dlpack_tables():
    table = _DLPackTable(DOC2)
    compiled = omnicupy.compile_mask(lambda b, h, q, kv: table[b, q] == table[b, kv])
    b, h, q, kv = _grid(n_q=120, n_kv=120)
    want = DOC2[b, q] == DOC2[b, kv]
    np.testing.assert_array_equal(np.broadcast_to(compiled(b, h, q, kv), want.shape), want)
    assert compiled.limits == {"b": 2, "q_idx": 120, "kv_idx": 120}


def test_2d_table_sizes_reach_the_expression_check():
    """A fused kernel checks only the CUDA expression's own array lengths: a 2-D table's row and
    column counts reach that check through guard arrays read in dead code."""
    compiled = omnicupy.compile_mask(lambda b, h, q, kv: DOC2[b, q] == DOC2[b, kv])
    assert "false && (" in compiled.cuda.text
    compiled.cuda.check_lengths(q_len=120, kv_len=120, heads=16, batch=2)
    for sizes in (dict(q_len=120, kv_len=120, heads=1, batch=3), dict(q_len=121, kv_len=120, heads=1, batch=2)):
        with pytest.raises(omnicupy.mask.expressions.ExpressionError):
            compiled.cuda.check_lengths(**sizes)
