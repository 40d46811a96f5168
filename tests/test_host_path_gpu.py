"""The steady-state call path: cached launches give the same results as first calls, attention()
never synchronizes the host with the device, and it can be captured in a CUDA graph and replayed
(issue: the host path). Every random input is seeded; the seed is in each assertion message."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, masks, reference

from helpers import TOLERANCE

pytestmark = pytest.mark.gpu

SEED = 20261123


def _inputs(cp, seed, B=2, H=4, N=777, D=128, dtype="fp16"):
    rng = cp.random.default_rng(seed)
    dt = cp.float16 if dtype == "fp16" else omnicupy.arrays.BFLOAT16
    return [rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(dt) for _ in range(3)]


def _gpu_mask(cp, n):
    """A mask built on the GPU (CuPy metadata), never used by a kernel yet."""
    segments = [("text", 100), ("image", 200), ("text", n - 300)]
    return BlockMask.from_mask_mod(masks.interleaved(segments), None, None, n, n, xp=cp) \
        if "xp" in BlockMask.from_mask_mod.__code__.co_varnames else \
        BlockMask.from_mask_mod(masks.interleaved(segments), None, None, n, n)


@pytest.mark.parametrize("kind", ["causal", "gpu_mask", "bias"])
def test_cached_calls_match_first_call(kind):
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    kwargs = {"causal": True} if kind == "causal" else {}
    if kind == "gpu_mask":
        kwargs["block_mask"] = _gpu_mask(cp, q.shape[2])
    if kind == "bias":
        kwargs["bias"] = cp.asarray(np.random.default_rng(SEED).standard_normal((1, 4, 777)).astype(np.float32))
    first = omnicupy.attention(q, k, v, **kwargs)
    for i in range(3):  # steady state: the recipe path, fresh data each time
        q2, k2, v2 = _inputs(cp, SEED + 1 + i)
        cached = omnicupy.attention(q2, k2, v2, **kwargs)
        fresh = omnicupy.attention(q2.copy(), k2.copy(), v2.copy(), **kwargs)  # other pointers, same recipe
        assert cp.array_equal(cached, fresh), f"seed {SEED + 1 + i}"
    again = omnicupy.attention(q, k, v, **kwargs)
    assert cp.array_equal(first, again), f"seed {SEED}"
    mask = kwargs.get("block_mask")
    mask_fn = masks.causal() if kind == "causal" else (mask.mask_mod if mask is not None else None)
    bias = None if kind != "bias" else kwargs["bias"].get()
    ref = reference.attention(q[:1].get(), k[:1].get(), v[:1].get(), mask_fn, bias=None if bias is None else bias)
    err = reference.relative_error(again[:1], ref)
    assert err <= TOLERANCE["fp16"], f"seed {SEED}: error {err}"


def test_attention_does_not_synchronize():
    cp = pytest.importorskip("cupy")
    cupyx = pytest.importorskip("cupyx")
    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2])
    # First call of a mask built on the GPU, and steady-state calls: no implicit synchronization.
    with cupyx.allow_synchronize(False):
        for _ in range(2):
            omnicupy.attention(q, k, v, bm)
            omnicupy.attention(q, k, v, causal=True, return_lse=True)
            omnicupy.attention(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("mask_kind", ["gpu_mask_unused", "causal"])
def test_graph_capture_and_replay(mask_kind):
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2]) if mask_kind == "gpu_mask_unused" else None
    kwargs = {"causal": True} if bm is None else {}
    out = cp.empty_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        omnicupy.attention(q, k, v, bm, out=out, **kwargs)
        graph = stream.end_capture()
    expected = omnicupy.attention(q, k, v, bm, **kwargs)
    out.fill(float("nan"))
    graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, expected), f"seed {SEED}"
    q2, k2, v2 = _inputs(cp, SEED + 7)  # replay reads whatever the captured buffers hold now
    with stream:  # the copies in the replay's stream: a non-blocking stream does not wait for the null one
        q[...], k[...], v[...] = q2, k2, v2
    graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, omnicupy.attention(q2, k2, v2, bm, **kwargs)), f"seed {SEED + 7}"
