"""Compiled = evaluated, bit for bit: random mask_mods (a random expression over the index names,
closure numbers and tables, written out as Python source), random lengths with tails and offsets;
``compile_mask(f)`` through its numpy_fn (the C semantics of the emitted text) against ``f`` evaluated
with NumPy broadcasting. A mask the compiler refuses (a possible overflow) is skipped, and counted."""
from __future__ import annotations

import linecache

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mask_mod_strategies import _mask_from_source, bool_exprs

import omnicupy
from omnicupy import MaskError

EXAMPLES = 3000


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
