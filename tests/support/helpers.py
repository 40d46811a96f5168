"""Test helpers: random inputs and random block masks whose element-level mask is built
independently of the metadata (so a metadata or bit-order bug cannot cancel out)."""
from __future__ import annotations

import os
import secrets

import numpy as np

import omnicupy
from omnicupy import BlockMask, BlockType, reference
from omnicupy.arrays import BFLOAT16
from omnicupy.mask.block_mask import cdiv

NP_DTYPES = {"fp16": np.dtype(np.float16), "bf16": BFLOAT16}
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}  # relative Frobenius error vs the float64 reference
#: A score modifier whose derivative (2) exceeds the deterministic backward's fixed-point bound:
#: deterministic calls with it take the mma.sync kernel's ordered fp32 sum.
DOUBLED_SCORE = omnicupy.score_mods.cuda_score("score * S", {"S": 2.0}, grad="S",
                                               numpy_fn=lambda s, b, h, i, j: s * 2.0,
                                               numpy_grad=lambda s, b, h, i, j: np.full_like(s, 2.0))
#: Set to replay a failing test's random inputs: the seed it printed (OMNICUPY_TEST_SEED=1234 pytest ...).
SEED_VARIABLE = "OMNICUPY_TEST_SEED"
#: (test id, seed) of the generator seeded_rng() made last (run_and_check names it in its failures).
last_seed = (None, None)


def _current_test() -> str:
    """The running test's node id (pytest keeps it in $PYTEST_CURRENT_TEST: "id (phase)")."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]


def seeded_rng(seed=None) -> np.random.Generator:
    """The generator of a test's random inputs: fresh inputs on every run, but seeded and logged, so
    that a failure can be replayed. The seed is ``seed``, else $OMNICUPY_TEST_SEED, else fresh
    entropy; it is printed (pytest shows it beside a failure) and named by run_and_check's failures."""
    global last_seed
    if seed is None:
        value = os.environ.get(SEED_VARIABLE, "").strip()
        seed = int(value) if value else secrets.randbits(32)
    last_seed = (_current_test(), seed)
    print(f"random inputs: seed {seed} (replay: {SEED_VARIABLE}={seed})")
    return np.random.default_rng(seed)


def seed_note() -> str:
    """`` (seed N ...)`` for assertion messages, when the running test drew its inputs from seeded_rng()."""
    test, seed = last_seed
    return f" (seed {seed}; replay with {SEED_VARIABLE}={seed})" if seed is not None and test == _current_test() else ""


def random_qkv(rng, B, Hq, Nq, D, dtype="fp16", Hkv=None, Nkv=None):
    Hkv = Hq if Hkv is None else Hkv
    Nkv = Nq if Nkv is None else Nkv
    dt = NP_DTYPES[dtype]
    q = rng.standard_normal((B, Hq, Nq, D)).astype(dt)
    k = rng.standard_normal((B, Hkv, Nkv, D)).astype(dt)
    v = rng.standard_normal((B, Hkv, Nkv, D)).astype(dt)
    return q, k, v


def device_view(x, layout: str = "contiguous"):
    """A device copy of x: contiguous; "bnhd", a [B, N, H, D] buffer viewed as [B, H, N, D] (strides not
    those of a contiguous array); "reversed", negative sequence strides."""
    import cupy as cp

    if layout == "contiguous":
        return cp.asarray(x)
    if layout == "bnhd":
        return cp.ascontiguousarray(cp.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert layout == "reversed", layout
    view = cp.asarray(np.ascontiguousarray(x[:, :, ::-1]))[:, :, ::-1]
    assert view.strides[2] < 0
    return view


def pack_bits(bits: np.ndarray) -> np.ndarray:
    """bool [rows, cols] -> uint32 [rows, cols/32], bit c of word w = column 32w + c."""
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def random_block_mask(rng, Bm, Hm, q_len, kv_len, q_block_size=128, kv_block_size=128,
                      probs=(0.25, 0.25, 0.25, 0.25), empty_q_blocks=0, shuffle=False):
    """A random mix of MASKED/CAUSAL/FULL/PARTIAL blocks. Returns (BlockMask, dense bool mask).

    ``empty_q_blocks`` q blocks of each (b, h) get no kv blocks at all; partial blocks include rows
    with no allowed key. ``shuffle`` lists each row's blocks in random order with some MASKED entries
    among the active ones (which the kernel must skip)."""
    nqb, nkvb = cdiv(q_len, q_block_size), cdiv(kv_len, kv_block_size)
    grid = rng.choice(4, size=(Bm, Hm, nqb, nkvb), p=probs)
    # CAUSAL is valid only where the diagonal cuts a block: elsewhere the causal rule makes it FULL
    # (wholly below the diagonal) or MASKED (wholly above).
    q_lo = np.arange(nqb)[:, None] * q_block_size
    kv_lo = np.arange(nkvb)[None, :] * kv_block_size
    below = np.minimum(kv_lo + kv_block_size, kv_len) - 1 <= q_lo
    above = kv_lo > np.minimum(q_lo + q_block_size, q_len) - 1
    grid = np.where((grid == BlockType.CAUSAL) & below, BlockType.FULL, grid)
    grid = np.where((grid == BlockType.CAUSAL) & above, BlockType.MASKED, grid)
    for b in range(Bm):
        for h in range(Hm):
            grid[b, h, rng.permutation(nqb)[:empty_q_blocks]] = BlockType.MASKED
    dense = np.zeros((Bm, Hm, nqb * q_block_size, nkvb * kv_block_size), dtype=bool)
    partial_grid = np.zeros_like(grid)
    pool = []
    q_pos = np.arange(q_block_size)[:, None]
    kv_pos = np.arange(kv_block_size)[None, :]
    for b, h, i, j in zip(*np.nonzero(grid)):
        rows = slice(i * q_block_size, (i + 1) * q_block_size)
        cols = slice(j * kv_block_size, (j + 1) * kv_block_size)
        kind = grid[b, h, i, j]
        if kind == BlockType.FULL:
            dense[b, h, rows, cols] = True
        elif kind == BlockType.CAUSAL:
            dense[b, h, rows, cols] = (i * q_block_size + q_pos) >= (j * kv_block_size + kv_pos)
        else:
            bits = rng.random((q_block_size, kv_block_size)) < rng.uniform(0.1, 0.9)
            bits[rng.random(q_block_size) < 0.1] = False  # some rows with nothing allowed here
            dense[b, h, rows, cols] = bits
            partial_grid[b, h, i, j] = len(pool)
            pool.append(pack_bits(bits))
    pool_arr = np.stack(pool) if pool else None
    bm = BlockMask.from_block_types(grid, q_len=q_len, kv_len=kv_len, q_block_size=q_block_size,
                                    kv_block_size=kv_block_size,
                                    partial_grid=partial_grid if pool else None, partial_block_masks=pool_arr)
    if shuffle:
        bm = shuffled(bm, rng)
    return bm, dense[:, :, :q_len, :kv_len]


def shuffled(bm: BlockMask, rng) -> BlockMask:
    """The same mask with each row's entries permuted and MASKED entries mixed into the active range."""
    nb, idx, types = bm.kv_num_blocks, bm.kv_indices, bm.block_mask_types
    pidx = bm.partial_block_mask_indices
    Bm, Hm, nqb, maxb = idx.shape
    unused_kv = bm.num_kv_blocks  # a MASKED entry still must name a valid, unlisted kv block
    width = maxb + 2
    new_nb = np.zeros_like(nb)
    new_idx = np.zeros((Bm, Hm, nqb, width), np.int32)
    new_types = np.zeros_like(new_idx)
    new_pidx = np.zeros_like(new_idx)
    for b, h, i in np.ndindex(Bm, Hm, nqb):
        n = int(nb[b, h, i])
        listed = set(idx[b, h, i, :n].tolist())
        spare = [kv for kv in range(unused_kv) if kv not in listed][:2]
        entries = [(idx[b, h, i, e], types[b, h, i, e], 0 if pidx is None else pidx[b, h, i, e]) for e in range(n)]
        entries += [(kv, BlockType.MASKED, 0) for kv in spare]
        order = rng.permutation(len(entries))
        new_nb[b, h, i] = len(entries)
        for slot, e in enumerate(order):
            new_idx[b, h, i, slot], new_types[b, h, i, slot], new_pidx[b, h, i, slot] = entries[e]
    return BlockMask(new_nb, new_idx, new_types, q_len=bm.q_len, kv_len=bm.kv_len, q_block_size=bm.q_block_size,
                     kv_block_size=bm.kv_block_size,
                     partial_block_mask_indices=None if pidx is None else new_pidx,
                     partial_block_masks=bm.partial_block_masks)


def run_and_check(q, k, v, dense, dtype, *, block_mask=None, causal=False, stages=None, scale=None,
                  check_lse=True, layout="contiguous", bias=None, score_mod=None, fuse_mask=True):
    """Run omnicupy on device copies of q, k, v (``layout``: contiguous; "bnhd", strided views of a
    [B, N, H, D] buffer; "reversed", views with negative sequence strides) with a NaN-poisoned
    output buffer, and compare output and LSE with the float64 reference. Returns (error, output)."""
    import cupy as cp

    qd, kd, vd = (device_view(x, layout) for x in (q, k, v))
    out = cp.full(q.shape, np.nan, dtype=q.dtype)  # poisoned: every element must be written
    got, lse = omnicupy.attention(qd, kd, vd, block_mask, causal=causal, stages=stages, scale=scale,
                                  return_lse=True, out=out, bias=bias, score_mod=score_mod, fuse_mask=fuse_mask)
    assert got is out
    want, want_lse = reference.attention(q, k, v, dense, scale=scale, return_lse=True, bias=bias,
                                         score_mod=score_mod)
    got = got.get().astype(np.float64)
    note = seed_note()
    assert not np.isnan(got).any(), "unwritten or NaN output" + note
    err = reference.relative_error(got, want)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e} > {TOLERANCE[dtype]}" + note
    empty = ~np.broadcast_to(dense, want.shape[:3] + (dense.shape[-1],)).any(axis=-1)
    assert np.all(got[empty] == 0), "rows with no allowed key must be exactly 0" + note
    if check_lse:
        lse = lse.get()
        assert np.all(np.isneginf(lse[empty])), "empty rows must have LSE -inf" + note
        np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=2e-3, rtol=0, err_msg="LSE" + note)
    return err, got
