"""Compiled = evaluated, bit for bit: random mask_mods (a random expression over the index names,
closure numbers and tables, written out as Python source), random lengths with tails and offsets;
``compile_mask(f)`` through its numpy_fn (the C semantics of the emitted text) against ``f`` evaluated
with NumPy broadcasting. A mask the compiler refuses (a possible overflow) is skipped, and counted."""
from __future__ import annotations

import itertools
import linecache

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import omnicupy
from omnicupy import MaskError

EXAMPLES = 3000
_counter = itertools.count()
TABLE = np.random.default_rng(0).integers(-20, 20, size=1200)
TABLE2 = np.random.default_rng(1).integers(0, 5, size=(2, 1200))
FLAGS = np.random.default_rng(2).integers(0, 2, size=1200).astype(bool)

_int_leaf = st.one_of(
    st.sampled_from(["q_idx", "kv_idx", "h", "b", "c0", "c1", "cpos"]),
    st.integers(-40, 40).map(lambda v: f"({v})"),
)


def _ints(children):
    small = st.integers(-9, 9).filter(bool).map(lambda v: f"({v})")
    divisor = st.one_of(small, st.just("cpos"))
    return st.one_of(
        st.tuples(children, st.sampled_from(["+", "-"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(children, small).map(lambda t: f"({t[0]} * {t[1]})"),
        st.tuples(children, st.sampled_from(["//", "%"]), divisor).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["np.minimum", "np.maximum"]), children, children).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        children.map(lambda x: f"np.abs({x})"),
        children.map(lambda x: f"(-{x})"),
        st.sampled_from(["q_idx", "kv_idx"]).map(lambda a: f"table[{a}]"),
        st.tuples(children, st.integers(1, 30)).map(lambda t: f"table[np.clip({t[0]}, 0, {t[1]})]"),
        st.sampled_from(["q_idx", "kv_idx"]).map(lambda a: f"table2[b, {a}]"),
    )


int_exprs = st.recursive(_int_leaf, _ints, max_leaves=6)


def _bools(children):
    return st.one_of(
        st.tuples(children, st.sampled_from(["&", "|", "^"]), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        children.map(lambda x: f"(~{x})"),
        st.tuples(children, children, children).map(lambda t: f"np.where({t[0]}, {t[1]}, {t[2]})"),
        children.map(lambda x: f"np.logical_not({x})"),
    )


comparisons = st.one_of(
    st.tuples(int_exprs, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), int_exprs).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"),
    st.sampled_from(["q_idx", "kv_idx"]).map(lambda a: f"flags[{a}]"),
)
bool_exprs = st.recursive(comparisons, _bools, max_leaves=4)


def _mask_from_source(expr: str, c0: int, c1: int, cpos: int):
    """A real function with source (registered in linecache as a notebook would), closing over
    c0, c1, cpos and the tables."""
    filename = f"<omnicupy-property-{next(_counter)}>"
    source = (f"def make(c0, c1, cpos, table, table2, flags):\n"
              f"    def mask(b, h, q_idx, kv_idx):\n"
              f"        return {expr}\n"
              f"    return mask\n")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"np": np}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the test's own generated source
    return namespace["make"](c0, c1, cpos, TABLE, TABLE2, FLAGS), filename


skipped = {"refused": 0, "sizes": 0, "run": 0}  # what the run did (printed with -s by the last line)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.filter_too_much])
@given(expr=bool_exprs, c0=st.integers(-100, 100), c1=st.integers(-3000, 3000), cpos=st.integers(1, 300),
       n_q=st.integers(1, 200), n_kv=st.integers(1, 200), q0=st.integers(0, 900), kv0=st.integers(0, 900),
       batch=st.integers(1, 2), heads=st.integers(1, 3))
def test_compiled_equals_evaluated(expr, c0, c1, cpos, n_q, n_kv, q0, kv0, batch, heads):
    fn, filename = _mask_from_source(expr, c0, c1, cpos)
    try:
        try:
            compiled = omnicupy.compile_mask(fn)
        except MaskError as exc:
            # What the generator can write that is refused: a possible overflow, and Python's own int
            # semantics of literal booleans (~(1 < 0) is -1, not True) where a boolean is needed.
            assert "int32" in str(exc) or "boolean" in str(exc), str(exc)
            skipped["refused"] += 1
            assume(False)
        b = np.arange(batch).reshape(-1, 1, 1, 1)
        h = np.arange(heads).reshape(1, -1, 1, 1)
        q = np.arange(q0, q0 + n_q).reshape(1, 1, -1, 1)
        kv = np.arange(kv0, kv0 + n_kv).reshape(1, 1, 1, -1)
        shape = (batch, heads, n_q, n_kv)
        if compiled.why_not(batch=batch, heads=heads, q_len=q0 + n_q, kv_len=kv0 + n_kv) is not None:
            skipped["sizes"] += 1  # compiled for shorter sequences than these (its arithmetic would overflow)
            assume(False)
        want = np.broadcast_to(fn(b, h, q, kv), shape)
        got = np.broadcast_to(compiled(b, h, q, kv), shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{expr}\n-> {compiled.cuda.text}")
        skipped["run"] += 1
    finally:
        linecache.cache.pop(filename, None)
