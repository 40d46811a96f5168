"""Shared by the decode tests (CPU and GPU) and tests/sanitize/sanitize_decode.py: paged caches scattered from
contiguous ones, per-case seeds, and the comparison against the float64 reference."""
from __future__ import annotations

import zlib

import numpy as np

from omnicupy import reference

TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}  # relative Frobenius error vs the float64 reference


def seed_of(label: str) -> int:
    """A stable seed per test case (printed in every failure message, so a failure can be replayed)."""
    return zlib.crc32(label.encode())


def paged_from_contiguous(rng, k, v, page_size, layout, lens, spare_pages=3):
    """Scatter contiguous caches [B, Hkv, N, D] into shuffled pages (the same pages for k and v);
    table entries past a sequence's last page are -1 (padding, never read)."""
    B, Hkv, N, D = k.shape
    per_seq = [-(-int(n) // page_size) for n in lens]
    num_pages = sum(per_seq) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((B, max(max(per_seq), 1) + 1), -1, np.int32)
    kp = np.zeros((num_pages, page_size, Hkv, D), k.dtype)
    vp = np.zeros_like(kp)
    at = 0
    for b in range(B):
        for p in range(per_seq[b]):
            table[b, p] = page = order[at]
            at += 1
            rows = slice(p * page_size, min((p + 1) * page_size, N))
            kp[page, :rows.stop - rows.start] = k[b, :, rows].transpose(1, 0, 2)
            vp[page, :rows.stop - rows.start] = v[b, :, rows].transpose(1, 0, 2)
    if layout == "HND":
        kp, vp = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (kp, vp))
    return kp, vp, table


def host(x):
    """float64 NumPy copy of a CuPy or NumPy array (fp16, bf16 or fp32)."""
    if hasattr(x, "get"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def compare(got, lse, want, want_lse, dtype, label, seed):
    """Output within tolerance, no NaN; rows with no key exactly 0 with LSE -inf; LSE to 2e-3."""
    got = host(got)
    where = f"{label} (seed {seed})"
    assert np.all(np.isfinite(got)), f"{where}: NaN or inf in the output (unwritten rows?)"
    err = reference.relative_error(got, want)
    assert err <= TOLERANCE[dtype], f"{where}: relative error {err:.2e} > {TOLERANCE[dtype]}"
    empty = np.isneginf(want_lse)
    assert np.all(got[empty] == 0), f"{where}: rows with no allowed key must be exactly 0"
    if lse is not None:
        lse = host(lse)
        assert np.all(np.isneginf(lse[empty])), f"{where}: empty rows must have LSE -inf"
        np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=2e-3, rtol=0, err_msg=where)
    return err


def causal_rows(q_rows, k, v, first_row):
    """float64 causal attention of the query rows ``first_row, first_row + 1, ...`` of one head
    against keys ``k``/``v`` ``[n, D]``: row i sees keys j <= i (checks of a few rows of a long
    sequence, without the reference's full score matrix)."""
    q64, k64, v64 = (host(x) for x in (q_rows, k, v))
    s = q64 @ k64.T / np.sqrt(q64.shape[-1])
    rows = np.arange(first_row, first_row + len(q64))[:, None]
    s = np.where(np.arange(len(k64))[None, :] <= rows, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v64
