"""Random mask_mods for property tests: hypothesis strategies of boolean expressions over the index
names, closure numbers and tables, and ``_mask_from_source``, which writes one out as a real Python
function with source (as a notebook would). Shared by tests/cpu/test_compile_mask_property.py and
tests/gpu/test_compile_mask_gpu.py."""
from __future__ import annotations

import itertools
import linecache

import numpy as np
from hypothesis import strategies as st

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
