"""benchmarks/bench_mask_families.py without a GPU: its options, the torch form of every family (with
NumPy standing in for torch: the same function, tables converted, np.minimum/np.maximum mapped to
selections) and the printed table."""
from __future__ import annotations

import types

import numpy as np
import pytest

from benchmarks import bench_mask_families as bench
from omnicupy.mask import families

FAKE_TORCH = types.SimpleNamespace(where=np.where, as_tensor=lambda x, device=None: np.asarray(x))


@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_torch_form_is_the_same_mask(name):
    fn, nq, nkv = families.examples(300, [name])[name]
    made = bench.torch_form(fn, FAKE_TORCH, device="cpu")
    q, kv = np.arange(nq)[:, None], np.arange(nkv)[None, :]
    assert made is not fn and made.__name__ == fn.__name__
    np.testing.assert_array_equal(np.broadcast_to(made(0, 0, q, kv), (nq, nkv)),
                                  np.broadcast_to(fn(0, 0, q, kv), (nq, nkv)))


@pytest.mark.parametrize("argv, sizes, dims", [
    ([], [8192, 32768], [64, 128]),
    (["--quick"], [8192], [128]),
    (["--sizes", "4096", "--head-dims", "64"], [4096], [64]),
])
def test_options(argv, sizes, dims):
    args = bench.parse(argv + ["--out", "x.json"])
    assert (args.sizes, args.head_dims) == (sizes, dims)
    assert (args.budget_s is not None) == ("--quick" in argv)


def test_table_ratios():
    run = types.SimpleNamespace(builds=[{"family": "prefix_lm", "seq_len": 8192, "omnicupy_warm_ms": 0.5,
                                         "flex_warm_ms": 2.0, "omnicupy_cold_ms": 900, "flex_cold_ms": 3000}],
                                rows=[{"family": "prefix_lm", "seq_len": 8192, "head_dim": 64, "system": s, "pass": p,
                                       "ms": ms} for s, ms in (("omnicupy", 1.0), ("flex", 1.5))
                                      for p in ("fwd", "bwd", "fwdbwd")])
    text = bench.table(run)
    assert "0.50/2.00" in text and text.splitlines()[1].split()[-3:] == ["1.50"] * 3
