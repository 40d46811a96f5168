"""omnicupy.distributed's device path (exchange.py, sharded_attention.py, sharding.unshard) on the
CPU: one thread per rank, NumPy behind CuPy's names, in-process queues behind NCCL, the float64
reference behind the kernels (tests/support/fake_devices.py). Checks what each rank sends, receives,
computes and returns; the stream and event ordering needs a GPU (tests/gpu/test_distributed_gpu.py).
"""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, arrays, masks, reference
from omnicupy.distributed import merge, planner, sharded_attention, sharding, steps

import fake_devices as fd
from distributed_cases import FAMILIES, family_mask, host_mask
from mask_cases import alternating_segments, random_lengths

SEED = 7_2026


@pytest.fixture
def fake_gpu(monkeypatch):
    """Call it to switch to the stand-ins (after building masks and plans, which use the real modules)."""

    def activate():
        cp = fd.FakeCupy()
        monkeypatch.setattr(arrays, "cupy_module", lambda: cp)
        monkeypatch.setattr(omnicupy, "attention", fd.fake_attention)
        monkeypatch.setattr(omnicupy, "attention_backward", fd.fake_attention_backward, raising=False)
        monkeypatch.setitem(merge._fused, "failed", True)  # no CUDA compiler behind the stand-ins
        monkeypatch.setattr(fd.FakeEvent, "done", property(lambda self: self.recorded), raising=False)  # runs at once
        return cp

    return activate


CASES = [  # (mask, N, ranks, schedule, strategy, heads, kv heads, route)
    pytest.param("causal", 1000, 2, "auto", None, 2, 2, id="causal-W2"),
    pytest.param("causal", 1536, 3, "auto", None, 2, 1, id="causal-W3-gqa"),
    pytest.param("causal", 2048, 4, "auto", "lpt", 2, 2, id="causal-W4-lpt"),
    pytest.param("sliding", 2400, 3, "auto", "lpt", 2, 2, id="sliding-W3-lpt-pieces"),
    pytest.param("document", 1700, 3, "auto", None, 2, 2, id="document-W3"),
    pytest.param("interleaved", 2000, 2, "auto", None, 2, 1, id="interleaved-W2-gqa"),
    pytest.param("causal", 1000, 3, "allgather", None, 2, 2, id="causal-W3-allgather"),
    pytest.param("full", 1024, 2, "auto", None, 2, 2, id="full-W2-auto-allgather"),
    pytest.param("blocks", 1024, 4, "auto", "contiguous", 2, 2, id="block-diagonal-W4-no-traffic"),
]
CASES = [pytest.param(*c.values, "keys" if c.values[0] != "full" else "auto", id=c.id) for c in CASES] + [
    # travelling queries (routing.py): chosen by the planner, and forced on every remote pair
    pytest.param("global_window", 2048, 4, "auto", None, 2, 2, "auto", id="global-window-W4-auto"),
    pytest.param("global_window", 1024, 2, "auto", None, 4, 2, "auto", id="global-window-W2-auto-gqa"),
    pytest.param("causal", 1536, 3, "auto", None, 2, 1, "queries", id="causal-W3-queries-gqa"),
    pytest.param("sliding", 2400, 3, "auto", "lpt", 2, 2, "queries", id="sliding-W3-lpt-queries-pieces"),
    pytest.param("document", 1700, 4, "auto", None, 2, 2, "queries", id="document-W4-queries"),
    pytest.param("shared_prefix", 2048, 4, "auto", None, 2, 2, "queries", id="shared-prefix-W4-queries"),
    pytest.param("cross_attention", 2048, 2, "auto", None, 2, 2, "queries", id="cross-attention-W2-queries"),
]


def build(name, n):
    if name in FAMILIES:
        return family_mask(name, n, block=64)
    mod = {
        "causal": masks.causal(),
        "sliding": masks.sliding_window(200),
        "document": masks.document(masks.doc_ids_from_lengths(random_lengths(n, 40, 400, seed=n))),
        "interleaved": masks.interleaved(alternating_segments(n, 90, 140)),
        "full": masks.local_window(n, n),
        "blocks": masks.block_diagonal([256] * (n // 256)),
    }[name]
    qbs = 64 if name == "sliding" else 128
    return host_mask(mod, n, q_block_size=qbs, kv_block_size=qbs)


@pytest.mark.parametrize("name,n,world,schedule,strategy,heads,kv_heads,route", CASES)
def test_threads_match_the_whole_sequence(fake_gpu, name, n, world, schedule, strategy, heads, kv_heads, route):
    rng = np.random.default_rng(SEED + n)
    D = 16
    bm = build(name, n)
    dense = bm.to_dense()
    q = rng.standard_normal((1, heads, n, D)).astype(np.float16)
    k, v = (rng.standard_normal((1, kv_heads, n, D)).astype(np.float16) for _ in range(2))
    dout = rng.standard_normal((1, heads, n, D)).astype(np.float16)
    chunks = 4 if strategy == "lpt" else None
    plan = planner.plan(bm, world, schedule=schedule, strategy=strategy, chunks_per_rank=chunks, route=route,
                        heads=(heads, kv_heads))
    if route == "queries" or name == "global_window":
        assert plan.moved.any(), plan
    for r in range(world):
        steps.program(plan, r)  # built with the real modules
    fake_gpu()
    fd_world = fd.World(world)
    comms = [fd.FakeComm(fd_world, r) for r in range(world)]

    def rank_fn(rank):
        comm = comms[rank]
        shards = [fd.fake(sharding.shard(x, plan, rank)) for x in (q, k, v, dout)]
        out_r, lse_r = sharded_attention.attention(*shards[:3], plan, comm, return_lse=True)
        forward_bytes = comm.sent_bytes
        grads = sharded_attention.attention_backward(shards[3], *shards[:3], out_r, lse_r, plan, comm)
        backward_bytes = comm.sent_bytes - forward_bytes
        whole = [sharding.unshard(x, plan, comm) for x in (out_r, lse_r, *grads)]
        return (forward_bytes, backward_bytes), whole

    results = fd.run_ranks(world, rank_fn)
    want_o, want_lse = reference.attention(q, k, v, dense, return_lse=True)
    want = fd.pair_gradients(q, k, v, dout, want_o.astype(np.float16), want_lse, dense, None)
    where = f"{name}, {world} ranks, seed {SEED + n}, plan {plan.strategy}/{plan.schedule}"
    for rank, ((forward_bytes, backward_bytes), (out, lse, dq, dk, dv)) in enumerate(results):
        assert reference.relative_error(out, want_o) < 3e-3, where
        finite = np.isfinite(want_lse)
        assert np.array_equal(np.isfinite(lse), finite) and np.allclose(lse[finite], want_lse[finite], atol=1e-4)
        for g, w, what in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
            assert reference.relative_error(g, w) < 3e-3, f"{what}: {where}"
        # the forward sent exactly what the plan says
        shapes = dict(batch=1, kv_heads=kv_heads, head_dim=D, itemsize=2, q_heads=heads)
        assert forward_bytes == plan.bytes_sent(rank, **shapes), where
        if plan.schedule == "ring":  # the all-gather's backward returns pad nothing: bytes_sent counts padding
            assert backward_bytes == plan.bytes_sent(rank, **shapes, backward=True), where


def test_numpy_shards_give_numpy_results(fake_gpu):
    bm = BlockMask.causal(512, 512)
    plan = planner.plan(bm, 1)
    steps.program(plan, 0)
    fake_gpu()
    q = np.random.default_rng(SEED).standard_normal((1, 1, 512, 16)).astype(np.float16)
    out = sharded_attention.attention(q, q, q, plan, fd.FakeComm(fd.World(1), 0))
    assert type(out) is np.ndarray and out.dtype == np.float16
    want = reference.attention(q, q, q, bm.to_dense())
    assert reference.relative_error(out, want) < 3e-3


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # transfers-only timing sends unset buffers
def test_the_benchmark_runs_on_the_stand_ins(fake_gpu, monkeypatch):
    """benchmarks/bench_context_parallel.py's per-rank work, end to end on two threads (times are fake)."""
    import sys
    from argparse import Namespace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_context_parallel as bench

    args = Namespace(n=1024, heads=1, kv_heads=1, head_dim=16, dtype="fp16", seed=SEED, repeats=1, strategy=None,
                     route="auto")
    fake_gpu()
    world = fd.World(2)
    comms = [fd.FakeComm(world, r) for r in range(2)]
    monkeypatch.setattr(bench, "build_mask", lambda name, n: family_mask(name, n, block=64))
    names = ("causal", "global_window")  # keys travel; queries travel
    rows = fd.run_ranks(2, lambda r: [bench.run_mask(name, args, comms[r]) for name in names])
    assert "auto" in rows[0][1]["plan"], rows[0][1]["plan"]
    for row in rows[0]:
        assert row["correct"], row
        for key in ("forward_ms", "both_ms", "compute_both_ms", "transfer_both_ms", "model_forward_ms",
                    "hidden_forward", "speedup_both"):
            assert key in row, (row["mask"], key)
    assert "causal" in bench.table(rows[0]).splitlines()[2]


@pytest.mark.parametrize("route", ["keys", "queries"])
def test_sinks_join_each_row_once(fake_gpu, route):
    """Sink logits enter a row's normalizer once whatever the number of partials; dsinks sums over ranks."""
    n, world, heads, D = 1024, 3, 2, 16
    rng = np.random.default_rng(SEED + 39)
    bm = family_mask("global_window", n, block=64)
    dense = bm.to_dense()
    q, dout = (rng.standard_normal((1, heads, n, D)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n, D)).astype(np.float16) for _ in range(2))
    sinks = np.array([0.5, -1.0], np.float32)
    plan = planner.plan(bm, world, route=route, heads=(heads, 1))
    for r in range(world):
        steps.program(plan, r)
    fake_gpu()
    shared = fd.World(world)
    comms = [fd.FakeComm(shared, r) for r in range(world)]

    def rank_fn(rank):
        comm = comms[rank]
        sh = [fd.fake(sharding.shard(x, plan, rank)) for x in (q, k, v, dout)]
        out_r, lse_r = sharded_attention.attention(*sh[:3], plan, comm, return_lse=True, sinks=sinks)
        grads = sharded_attention.attention_backward(sh[3], *sh[:3], out_r, lse_r, plan, comm, sinks=sinks)
        return [sharding.unshard(x, plan, comm) for x in (out_r, lse_r, *grads[:3])], np.asarray(grads[3])

    results = fd.run_ranks(world, rank_fn)
    want_o, want_lse = reference.attention(q, k, v, dense, return_lse=True, sinks=sinks)
    want = reference.attention_backward(dout, q, k, v, dense, sinks=sinks, return_grads=("dq", "dk", "dv", "dsinks"))
    for (out, lse, dq, dk, dv), dsinks in results:
        assert reference.relative_error(out, want_o) < 3e-3
        np.testing.assert_allclose(lse, want_lse, atol=1e-4)
        for g, w, what in zip((dq, dk, dv), want[:3], ("dq", "dk", "dv")):
            assert reference.relative_error(g, w) < 3e-3, f"{what} seed {SEED + 39}"
        np.testing.assert_allclose(dsinks, want[3], rtol=3e-3, atol=1e-3)


@pytest.mark.parametrize("name,world,heads,kv_heads", [("causal", 2, 4, 2), ("global_window", 4, 8, 4),
                                                       ("document", 3, 6, 3)])
def test_head_parallel_matches_the_whole_sequence(fake_gpu, name, world, heads, kv_heads):
    """Head parallelism (heads.py): two all-to-alls over heads, the whole sequence per head group."""
    n, D = 1536, 16
    rng = np.random.default_rng(SEED + world)
    bm = family_mask(name, n, block=64)
    dense = bm.to_dense()
    q, dout = (rng.standard_normal((1, heads, n, D)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, kv_heads, n, D)).astype(np.float16) for _ in range(2))
    plan = planner.plan(bm, world, heads=(heads, kv_heads), head_parallel=True)
    assert plan.head_parallel == world and "head parallel" in str(plan)
    fake_gpu()
    shared = fd.World(world)
    comms = [fd.FakeComm(shared, r) for r in range(world)]
    shapes = dict(batch=1, kv_heads=kv_heads, head_dim=D, itemsize=2, q_heads=heads)

    def rank_fn(rank):
        comm = comms[rank]
        sh = [fd.fake(sharding.shard(x, plan, rank)) for x in (q, k, v, dout)]
        out_r, lse_r = sharded_attention.attention(*sh[:3], plan, comm, return_lse=True)
        fwd = comm.sent_bytes
        grads = sharded_attention.attention_backward(sh[3], *sh[:3], out_r, lse_r, plan, comm)
        bwd = comm.sent_bytes - fwd
        assert fwd == plan.bytes_sent(rank, **shapes) and bwd == plan.bytes_sent(rank, **shapes, backward=True)
        return [sharding.unshard(x, plan, comm) for x in (out_r, lse_r, *grads)]

    results = fd.run_ranks(world, rank_fn)
    want_o, want_lse = reference.attention(q, k, v, dense, return_lse=True)
    want = fd.pair_gradients(q, k, v, dout, want_o.astype(np.float16), want_lse, dense, None)
    for out, lse, dq, dk, dv in results:
        assert reference.relative_error(out, want_o) < 3e-3
        finite = np.isfinite(want_lse)
        assert np.allclose(lse[finite], want_lse[finite], atol=1e-4)
        for g, w, what in zip((dq, dk, dv), want, ("dq", "dk", "dv")):
            assert reference.relative_error(g, w) < 3e-3, f"{what} {name} seed {SEED + world}"


def test_head_parallel_needs_divisible_kv_heads():
    bm = family_mask("causal", 1024, block=64)
    with pytest.raises(omnicupy.errors.ArgumentError, match="kv head"):
        planner.plan(bm, 4, heads=(8, 2), head_parallel=True)
    assert planner.plan(bm, 4, heads=(8, 2), head_parallel="auto").head_parallel == 1  # GQA bounds it
