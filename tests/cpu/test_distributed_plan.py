"""omnicupy.distributed on the host: the planner, sub-masks, per-rank programs, the LSE merge and a
NumPy replay of the whole distributed forward and backward. No GPU, no NCCL.

The replay runs every rank's program with the float64 reference in place of the kernels: messages
are cut from the sender's shard by the sender's runs and checked against what the receiver
expects, each partial is computed on the receiver's sub-mask, merged with the package's merge,
and the backward's dK/dV partials are added at the sender's runs. The result must equal the
float64 reference on the whole sequence, so a wrong unit, run, offset or sub-mask fails it.
"""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy import BlockMask, BlockType, masks, reference
from omnicupy.distributed import comm as comm_module
from omnicupy.distributed import errors, merge, model, planner, sharding, steps, submask
from omnicupy.distributed import sharded_attention
from omnicupy.errors import ArgumentError, MaskError

from distributed_cases import host_mask, issue_mask
from distributed_replay import check_replay
from helpers import random_block_mask
from mask_cases import alternating_segments, random_lengths

SEED = 20261124


# ------------------------------------------------------------------------------ workloads
def small_mask(name: str, n: int, rng, qbs: int = 128, kbs: int = 128):
    """(BlockMask, dense bool mask [Bm, Hm, n, n]) for the small cases."""
    if name == "random_per_head":
        return random_block_mask(rng, 1, 2, n, n, qbs, kbs)
    mods = {
        "causal": masks.causal(),
        "sliding_window_200": masks.sliding_window(200),
        "document": masks.document(masks.doc_ids_from_lengths(random_lengths(n, 40, 400, seed=n))),
        "interleaved": masks.interleaved(alternating_segments(n, 90, 140)),
        "prefix_lm_300": masks.prefix_lm(300),
        "full": masks.local_window(n, n),
    }
    bm = host_mask(mods[name], n, q_block_size=qbs, kv_block_size=kbs)
    return bm, bm.to_dense()


SMALL_CASES = [  # (mask, N, ranks, q block, kv block, strategy or None for the planner's choice)
    pytest.param("causal", 1000, 2, 128, 128, None, id="causal-N1000-W2"),
    pytest.param("causal", 1536, 3, 128, 128, None, id="causal-N1536-W3"),
    pytest.param("causal", 1000, 4, 64, 128, None, id="causal-N1000-W4-qbs64"),
    pytest.param("sliding_window_200", 1900, 4, 128, 128, None, id="sliding-N1900-W4"),
    pytest.param("sliding_window_200", 2400, 3, 64, 64, "lpt", id="sliding-N2400-W3-lpt"),
    pytest.param("document", 1700, 3, 128, 64, None, id="document-N1700-W3-kbs64"),
    pytest.param("document", 2600, 2, 64, 64, "lpt", id="document-N2600-W2-lpt"),
    pytest.param("interleaved", 2000, 4, 128, 128, None, id="interleaved-N2000-W4"),
    pytest.param("prefix_lm_300", 1280, 2, 128, 128, None, id="prefix_lm-N1280-W2"),
    pytest.param("random_per_head", 1100, 3, 64, 64, None, id="random-per-head-N1100-W3"),
    pytest.param("full", 1024, 2, 128, 128, None, id="full-N1024-W2"),
]


def small_plan(name, n, world, qbs, kbs, strategy, seed=SEED):
    """(plan, dense mask) of one small case."""
    bm, dense = small_mask(name, n, np.random.default_rng(seed), qbs, kbs)
    chunks = 4 if strategy == "lpt" else None
    return planner.plan(bm, world, strategy=strategy, chunks_per_rank=chunks), dense


def positions_by_rank(plan):
    return [plan.positions(r) for r in range(plan.world_size)]


# ---------------------------------------------------------------------------------- balance
@pytest.mark.parametrize("name", ["causal", "document", "interleaved", "sliding_window_4096"])
def test_balance_at_8_ranks(name):
    """The issue's target: heaviest rank's block work <= 1.05 x the mean at 8 ranks, N = 131072."""
    n = 131072
    bm = host_mask(issue_mask(name, n), n)
    plan = planner.plan(bm, 8)
    assert plan.imbalance <= 1.05, plan.summary()
    # the work is what the ranks' q units carry, counted independently from the block grid
    grid = bm.block_grid()[0, 0]
    weights = np.array([planner.BLOCK_WEIGHTS[t] for t in sorted(planner.BLOCK_WEIGHTS)])
    row_work = weights[grid].sum(axis=1)
    assert plan.rank_work.sum() == row_work.sum()  # travelling queries move work, never make or lose it
    keys = planner.plan(bm, 8, route="keys")  # keys only: a rank computes its own rows' work
    owner_of_row = keys.unit_owner[np.arange(grid.shape[0]) * 128 // keys.unit]
    np.testing.assert_allclose(keys.rank_work, np.bincount(owner_of_row, weights=row_work, minlength=8))
    assert keys.imbalance <= 1.05, keys.summary()


def test_zigzag_balances_causal_exactly():
    n = 16 * 128 * 8
    plan = planner.plan(BlockMask.causal(n, n), 8, strategy="zigzag")
    assert plan.imbalance == 1.0
    chunks = [np.flatnonzero(plan.chunk_owner == r).tolist() for r in range(8)]
    assert chunks == [[r, 15 - r] for r in range(8)]


def test_lpt_keeps_the_quota_and_refines():
    work = np.random.default_rng(SEED).integers(1, 1000, size=64).astype(float)
    owner = planner.lpt(work, 8)
    assert np.bincount(owner, minlength=8).tolist() == [8] * 8
    loads = np.bincount(owner, weights=work, minlength=8)
    assert loads.max() / loads.mean() < 1.01, f"seed {SEED}"


def test_equal_tokens_per_rank_and_every_unit_owned_once():
    n = 5000
    bm = host_mask(masks.causal(), n)
    for strategy in planner.STRATEGIES:
        plan = planner.plan(bm, 4, strategy=strategy)
        owned = np.concatenate(positions_by_rank(plan))
        assert np.array_equal(np.sort(owned), np.arange(n)), strategy
        lens = [plan.local_len(r) for r in range(4)]
        assert max(lens) - min(lens) <= plan.chunks_per_rank * plan.unit, (strategy, lens)


def test_weights_table_is_used():
    bm = BlockMask.causal(4096, 4096)
    plan = planner.plan(bm, 2, strategy="contiguous", weights={BlockType.CAUSAL: 5, "FULL": 3})
    grid = bm.block_grid()[0, 0]
    per_row = (np.where(grid == BlockType.FULL, 3, 0) + np.where(grid == BlockType.CAUSAL, 5, 0)).sum(axis=1)
    assert plan.rank_work.tolist() == [per_row[:16].sum(), per_row[16:].sum()]


@pytest.mark.parametrize("weights", [{0: 1}, {2: -1.0}, {"SOMETIMES": 1}, {7: 1}])
def test_bad_weights(weights):
    with pytest.raises(ArgumentError):
        planner.plan(BlockMask.causal(1024, 1024), 2, weights=weights)


# ----------------------------------------------------------------------- needed units
@pytest.mark.parametrize("name,n,world,qbs,kbs,strategy", SMALL_CASES)
def test_needed_units_match_brute_force(name, n, world, qbs, kbs, strategy):
    """need[r, u] is True exactly when some element of the dense mask links a query of rank r to a
    key of unit u (any batch or head)."""
    plan, dense = small_plan(name, n, world, qbs, kbs, strategy)
    any_bh = dense.any(axis=(0, 1))
    starts = plan.unit_starts()
    for r, pos in enumerate(positions_by_rank(plan)):
        rows = any_bh[pos]
        want = np.array([rows[:, starts[u]:starts[u + 1]].any() for u in range(plan.num_units)])
        assert np.array_equal(plan.need[r], want), f"{name} rank {r} seed {SEED}"


def test_sliding_window_sends_only_the_window():
    """Issue target: sliding window 4096, N = 131072, 2 ranks: bytes sent per rank <= 2x the window's K/V."""
    n, window = 131072, 4096
    bm = host_mask(masks.sliding_window(window), n)
    plan = planner.plan(bm, 2)
    shapes = dict(batch=1, kv_heads=16, head_dim=128, itemsize=2)
    window_kv = 2 * window * 16 * 128 * 2
    for r in range(2):
        assert plan.bytes_sent(r, **shapes) <= 2 * window_kv, plan.summary()
    assert plan.schedule == "ring"


def test_chunk_no_query_attends_to_is_never_sent():
    n = 8192
    bm = host_mask(masks.block_diagonal([2048] * 4), n)
    plan = planner.plan(bm, 4, strategy="contiguous")
    assert all(plan.tokens_sent(r) == 0 for r in range(4))
    prog = steps.program(plan, 1)
    assert all(s.send is None and s.recv is None and not s.parts for s in prog.remote_steps)
    assert prog.touched == () and prog.returned == ()


def test_full_mask_gathers_everything():
    n = 4096
    plan = planner.plan(BlockMask.full(n, n), 4)
    assert plan.schedule == "allgather" and plan.needed_fraction() == 1.0
    ring = planner.plan(BlockMask.full(n, n), 4, schedule="ring")
    assert ring.schedule == "ring"
    assert [ring.tokens_sent(r) for r in range(4)] == [3 * 1024] * 4


@pytest.mark.parametrize("kwargs,error", [
    (dict(world_size=0), ArgumentError),
    (dict(world_size=64), ArgumentError),  # 8 units cannot feed 64 ranks
    (dict(world_size=2, strategy="spiral"), ArgumentError),
    (dict(world_size=2, schedule="tree"), ArgumentError),
    (dict(world_size=2, strategy="zigzag", chunks_per_rank=3), ArgumentError),
    (dict(world_size=2, max_imbalance=0), ArgumentError),
])
def test_bad_plan_arguments(kwargs, error):
    with pytest.raises(error):
        planner.plan(BlockMask.causal(1024, 1024), **kwargs)


def test_plan_needs_one_sequence():
    with pytest.raises(MaskError, match="q_len"):
        planner.plan(BlockMask.causal(512, 1024), 2)
    with pytest.raises(ArgumentError):
        planner.plan("causal", 2)


def test_plan_is_deterministic():
    n = 131072
    bm = host_mask(issue_mask("document", n), n)
    a, b = planner.plan(bm, 8), planner.plan(bm, 8)
    assert np.array_equal(a.unit_owner, b.unit_owner) and a.strategy == b.strategy


# -------------------------------------------------------------------------------- sub-masks
@pytest.mark.parametrize("name,n,world,qbs,kbs,strategy", SMALL_CASES)
def test_step_submasks_match_the_dense_mask(name, n, world, qbs, kbs, strategy):
    """Every (rank, step) sub-mask encodes exactly the dense mask restricted to the rank's queries
    and the message's keys, in shard and message order."""
    plan, dense = small_plan(name, n, world, qbs, kbs, strategy)
    starts = plan.unit_starts()
    for r in range(world):
        prog = steps.program(plan, r)
        q_pos = plan.positions(r)
        for step in prog.steps:
            kv_units = plan.rank_units(r) if step.step == 0 else (step.recv.units if step.recv else np.zeros(0, int))
            kv_pos = planner.units_positions(kv_units, starts)
            want = dense[:, :, q_pos][:, :, :, kv_pos]
            covered = np.zeros(len(q_pos), dtype=bool)
            for part in step.parts:
                rows = slice(part.q_start, part.q_start + part.q_len)
                assert not covered[rows].any(), "parts overlap"
                covered[rows] = True
                got = part.mask.to_dense()
                part_want = want[:, :, rows]
                assert np.array_equal(np.broadcast_to(got, part_want.shape), part_want), \
                    f"{name} rank {r} step {step.step} seed {SEED}"
                if step.step:  # the part's rows sit in the compact accumulator where the program says
                    acc = [a + part.q_start - lo for lo, a, n in prog.touched if lo <= part.q_start < lo + n]
                    assert acc == [part.acc_start]
            if step.step:  # rows whose queries travel to the message's owner are computed there
                covered |= _travelling_rows(plan, r, step.src, q_pos)
            assert not want[:, :, ~covered].any(), f"{name} rank {r} step {step.step}: rows left out"
            if step.step and step.q_recv is not None:  # the guest mask: src's queries against all of r's keys
                g_pos = planner.units_positions(step.q_recv.units, starts)
                guest_want = dense[:, :, g_pos][:, :, :, q_pos]
                assert np.array_equal(np.broadcast_to(step.guest.to_dense(), guest_want.shape), guest_want)
        for lo, a, n in prog.returned:  # every returned row of a message lands in the compact buffer
            assert 0 <= lo and lo + n <= plan.local_len(r)
        for step in prog.remote_steps:
            if step.send:
                for (own, at, n), (acc, at2, n2) in zip(step.send.runs, step.send.acc_runs):
                    assert (at, n) == (at2, n2)
                    assert [a + own - lo for lo, a, m in prog.returned if lo <= own < lo + m] == [acc]


def _travelling_rows(plan, rank, dst, q_pos):
    """[L] bool: the rows of rank's shard whose queries travel to rank ``dst`` (routing.py)."""
    units = np.flatnonzero((plan.unit_owner == rank) & plan.moved[:, dst])
    return np.isin(q_pos, planner.units_positions(units, plan.unit_starts()))


def test_causal_blocks_stay_causal_in_the_local_step():
    n = 2048
    plan = planner.plan(BlockMask.causal(n, n), 2, strategy="zigzag")
    local = steps.program(plan, 0).steps[0].parts[0].mask
    assert local.features.causal and not local.features.partial
    (remote,) = steps.program(plan, 0).steps[1].parts  # rank 0's late chunk sees rank 1's chunks: FULL only
    assert not remote.mask.features.partial and remote.q_start == plan.local_len(0) // 2


def test_moved_causal_block_becomes_bits():
    """A CAUSAL block whose q and kv units land at different offsets takes its rule as a pattern."""
    bm = BlockMask.causal(512, 512)
    sub = submask.submask(bm, np.array([2, 3]), np.array([0, 3]), 128)  # unit 3's diagonal: q at 128, kv at 128
    assert sub.to_dense().shape[2:] == (256, 256)
    sub2 = submask.submask(bm, np.array([3]), np.array([1, 3]), 128)  # q unit 3 at 0, its keys at 128
    dense = bm.to_dense()[0, 0]
    want = dense[384:512][:, np.r_[128:256, 384:512]]
    assert np.array_equal(sub2.to_dense()[0, 0], want)
    assert sub2.features.partial  # the diagonal block moved: PARTIAL with a causal pattern


@pytest.mark.parametrize("units,error", [
    (np.array([3, 2]), "last"),  # the short tail unit must come last
    (np.array([0, 0]), "twice"),
    (np.array([9]), "outside"),
])
def test_submask_rejects_bad_units(units, error):
    bm = BlockMask.causal(500, 500)
    with pytest.raises(ArgumentError, match=error):
        submask.submask(bm, units, np.array([0]), 128)


def test_submask_keeps_the_pool_and_broadcast_dims():
    rng = np.random.default_rng(SEED)
    bm, dense = random_block_mask(rng, 1, 1, 640, 640, probs=(0.1, 0.1, 0.1, 0.7))
    wide = BlockMask(np.broadcast_to(bm.kv_num_blocks, (2, 3) + bm.kv_num_blocks.shape[2:]),
                     np.broadcast_to(bm.kv_indices, (2, 3) + bm.kv_indices.shape[2:]),
                     np.broadcast_to(bm.block_mask_types, (2, 3) + bm.block_mask_types.shape[2:]),
                     q_len=640, kv_len=640, partial_block_mask_indices=np.broadcast_to(
                         bm.partial_block_mask_indices, (2, 3) + bm.kv_indices.shape[2:]),
                     partial_block_masks=bm.partial_block_masks)
    sub = submask.submask(wide, np.array([1, 4]), np.array([0, 2, 4]), 128)
    assert sub.shape[:2] == (2, 3) and sub.kv_indices.strides[0] == 0
    assert sub.partial_block_masks.shape[0] >= bm.partial_block_masks.shape[0]
    want = dense[:, :, np.r_[128:256, 512:640]][:, :, :, np.r_[0:128, 256:384, 512:640]]
    assert np.array_equal(sub.to_dense()[:1, :1], want), f"seed {SEED}"


# --------------------------------------------------------------------------------- programs
@pytest.mark.parametrize("name,n,world,qbs,kbs,strategy", SMALL_CASES)
def test_messages_agree_between_sender_and_receiver(name, n, world, qbs, kbs, strategy):
    plan, _ = small_plan(name, n, world, qbs, kbs, strategy)
    progs = [steps.program(plan, r) for r in range(world)]
    for r, prog in enumerate(progs):
        own_pos = plan.positions(r)
        for step in prog.remote_steps:
            theirs = progs[step.dst].steps[step.step].recv
            mine = step.send
            assert (mine is None) == (theirs is None)
            if mine is None:
                continue
            assert np.array_equal(mine.units, theirs.units) and mine.length == theirs.length
            # the runs cut exactly the message's positions, in order, out of the shard
            cut = np.concatenate([own_pos[o:o + k] for o, _, k in mine.runs])
            assert np.array_equal(cut, planner.units_positions(mine.units, plan.unit_starts()))
            assert [a for _, a, _ in mine.runs] == list(np.cumsum([0] + [k for *_, k in mine.runs])[:-1])


def test_some_messages_skip_units_of_the_shard():
    """The small cases include messages cut from the middle of a shard (several runs), so the
    replay below checks the runs' offsets, not just whole shards."""
    plan, _ = small_plan("sliding_window_200", 2400, 3, 64, 64, "lpt")
    runs = [len(s.send.runs) for r in range(3) for s in steps.program(plan, r).remote_steps if s.send]
    assert max(runs) > 1 and any(not s.send.whole_shard for s in steps.program(plan, 0).remote_steps if s.send)


# ------------------------------------------------------------------------------------ merge
def test_merge_matches_one_softmax_and_never_nans():
    rng = np.random.default_rng(SEED)
    scores = rng.standard_normal((1, 2, 5, 12)) * 3
    values = rng.standard_normal((1, 2, 12, 4))
    allowed = rng.random((1, 2, 5, 12)) < 0.5
    allowed[0, 0, 1] = False  # a row with no key at all
    allowed[0, 1, 2, :6] = False  # a row empty in the first part only
    whole_o, whole_lse = softmax_parts(scores, values, allowed)
    acc = merge.PartialSum()
    for part in (slice(0, 6), slice(6, 9), slice(9, 12)):
        o, lse = softmax_parts(scores[..., part], values[:, :, part], allowed[..., part])
        acc.add(o.astype(np.float16), lse.astype(np.float32))
    out, lse = acc.result(np.float16, whole_o.shape, whole_lse.shape, np)
    assert np.all(np.isfinite(out)) and lse[0, 0, 1] == -np.inf and np.all(out[0, 0, 1] == 0)
    finite = np.isfinite(whole_lse)
    np.testing.assert_allclose(lse[finite], whole_lse[finite], rtol=1e-5, err_msg=f"seed {SEED}")
    assert reference.relative_error(out, whole_o) < 2e-3


def test_merge_of_nothing_is_empty():
    out, lse = merge.PartialSum().result(np.float16, (1, 1, 3, 2), (1, 1, 3), np)
    assert np.all(out == 0) and np.all(lse == -np.inf)


def softmax_parts(scores, values, allowed):
    s = np.where(allowed, scores, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    p = np.exp(s - top)
    total = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + top[..., 0], -np.inf)
    return (p / np.where(total > 0, total, 1)) @ values, lse


# ------------------------------------------------------------------ the whole call, replayed
@pytest.mark.parametrize("name,n,world,qbs,kbs,strategy", SMALL_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (2, 1)], ids=["mha", "gqa"])
def test_replayed_forward_and_backward_equal_the_whole(name, n, world, qbs, kbs, strategy, heads, kv_heads):
    plan, dense = small_plan(name, n, world, qbs, kbs, strategy)
    if plan.mask.shape[1] not in (1, heads):
        pytest.skip("per-head mask for another head count")
    check_replay(plan, dense, heads=heads, kv_heads=kv_heads, seed=SEED + n, where=name)


def test_shard_and_gather_round_trip():
    plan = planner.plan(BlockMask.causal(3000, 3000), 3)
    x = np.arange(2 * 3000 * 2, dtype=np.float32).reshape(2, 1, 3000, 2)
    shards = [sharding.shard(x, plan, r) for r in range(3)]
    assert [s.shape[2] for s in shards] == [plan.local_len(r) for r in range(3)]
    assert np.array_equal(sharding.gather_shards(shards, plan), x)
    lse = x[..., 0]
    assert np.array_equal(sharding.gather_shards([sharding.shard(lse, plan, r) for r in range(3)], plan), lse)
    with pytest.raises(ArgumentError):
        sharding.shard(x[:, :, :100], plan, 0)


# --------------------------------------------------------------------- launchers and errors
@pytest.mark.parametrize("environ,want", [
    ({}, comm_module.Launch("single")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
     comm_module.Launch("torchrun", 1, 2, 1, "10.0.0.1:29501")),
    ({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "::1", "MASTER_PORT": "29500", "OMNICUPY_NCCL_PORT": "4000"},
     comm_module.Launch("torchrun", 3, 4, 3, "[::1]:4000")),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, comm_module.Launch("mpi", -1, -1, -1)),
    ({"PMI_SIZE": "8"}, comm_module.Launch("mpi", -1, -1, -1)),
])
def test_detect_launch(environ, want):
    assert comm_module.detect_launch(environ) == want


@pytest.mark.parametrize("environ", [
    {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
    {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
])
def test_detect_launch_rejects_bad_environments(environ):
    with pytest.raises(errors.DistributedError):
        comm_module.detect_launch(environ)


def fake_communicator(rank, size):
    """A Communicator object with no NCCL behind it, for argument checks that run before any transfer."""
    comm = object.__new__(comm_module.Communicator)
    comm.rank, comm.size, comm.device, comm.nccl = rank, size, 0, None
    return comm


@pytest.mark.parametrize("change,error", [
    (dict(size=3), errors.DistributedError),
    (dict(q_len=100), ArgumentError),
    (dict(k_heads=3), ArgumentError),
    (dict(dtype=np.float32), ArgumentError),
    (dict(ndim=3), ArgumentError),
])
def test_sharded_attention_checks_before_any_transfer(change, error):
    plan = planner.plan(BlockMask.causal(1024, 1024), 2)
    n = change.get("q_len", plan.local_len(0))
    dtype = change.get("dtype", np.float16)
    q = np.zeros((1, 4, n, 64), dtype)
    k = np.zeros((1, change.get("k_heads", 2), plan.local_len(0), 64), dtype)
    if change.get("ndim") == 3:
        q = q[0]
    with pytest.raises(error):
        sharded_attention.attention(q, k, k, plan, fake_communicator(0, change.get("size", 2)))


def test_backward_says_when_the_single_gpu_backward_is_missing(monkeypatch):
    import omnicupy

    monkeypatch.delattr(omnicupy, "attention_backward", raising=False)
    plan = planner.plan(BlockMask.causal(1024, 1024), 2)
    x = np.zeros((1, 2, 512, 64), np.float16)
    with pytest.raises(errors.BackwardUnavailableError, match="attention_backward"):
        sharded_attention.attention_backward(x, x, x, x, x, np.zeros((1, 2, 512), np.float32), plan,
                                             fake_communicator(0, 2))


def test_init_rejects_other_objects(monkeypatch):
    class FakeNccl:
        available = True

        class NcclCommunicator:
            pass

    monkeypatch.setattr(comm_module, "nccl_module", lambda: FakeNccl)
    with pytest.raises(ArgumentError, match="comm must be"):
        comm_module.init(comm="not a communicator")


# ------------------------------------------------------------------------------- the model
def test_exchange_work_splits_each_ranks_work():
    n = 131072
    bm = host_mask(issue_mask("interleaved", n), n)
    plan = planner.plan(bm, 8)
    np.testing.assert_allclose(plan.exchange_work.sum(axis=1), plan.rank_work)
    for r in range(8):  # a rank computes with another exactly when it receives its keys or queries
        for s in range(1, 8):
            src = (r - s) % 8
            gets = plan.recv_units(r, s).size + plan.q_recv_units(r, s).size
            assert (plan.exchange_work[r, src] > 0) == (gets > 0), (r, s)


def test_model_of_one_rank_is_the_single_gpu():
    plan = planner.plan(BlockMask.causal(8192, 8192), 1)
    p = model.predict(plan)
    assert p.comm_ms == 0 and p.hidden == 1.0
    assert abs(p.distributed_ms - p.single_ms) < 1e-9


def test_model_two_gpus_causal_and_sliding_window():
    n = 131072
    causal = model.predict(planner.plan(BlockMask.causal(n, n), 2))
    assert 1.7 < causal.speedup <= 2.0 and causal.hidden > 0.9
    bm = host_mask(masks.sliding_window(4096), n)
    window = model.predict(planner.plan(bm, 2), backward=True)
    assert window.comm_ms < 0.05 * window.compute_ms


def test_model_efficiency_falls_when_the_network_carries_the_ring():
    rows = model.causal_table(lengths=(262144,), worlds=(8, 16, 32))
    eff = [r["forward"].efficiency for r in rows]
    assert eff[0] > 0.9 and eff[0] >= eff[1] >= eff[2]
    faster = model.calibrated(model.H200_NVLINK_IB, nvlink_gbs=400.0)
    assert faster.nvlink_gbs == 400.0 and faster.network_gbs == model.H200_NVLINK_IB.network_gbs


def test_distributed_imports_no_torch_and_no_nccl():
    import subprocess
    import sys

    code = ("import sys, omnicupy.distributed; "
            "assert 'torch' not in sys.modules and 'cupy_backends.cuda.libs.nccl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_remote_steps_compute_only_the_rows_that_attend():
    """A sliding window's message is computed (and merged) for the window's rows, not the shard's."""
    n, window = 131072, 4096
    bm = host_mask(masks.sliding_window(window), n)
    plan = planner.plan(bm, 2)
    prog = steps.program(plan, 1)
    (part,) = prog.steps[1].parts
    assert (part.q_start, part.q_len, part.acc_start) == (0, window, 0)
    assert plan.rows_attending(1, 0) == window and plan.rows_attending(0, 1) == 0
    assert prog.touched == ((0, 0, window),)
    assert steps.program(plan, 0).returned == ((plan.local_len(0) - window, 0, window),)


@pytest.mark.parametrize("type_name", ["float16", "bfloat16", "float"])
def test_fused_merge_source_compiles(type_name):
    """The fused merge's body, with CuPy's float16/bfloat16 classes, compiles with NVRTC (no GPU needed)."""
    from pathlib import Path

    cupy = pytest.importorskip("cupy")
    runtime = pytest.importorskip("nvidia.cuda_runtime")
    from omnicupy.jit.compiler import compile_cubin

    headers = [Path(cupy.__file__).parent / "_core" / "include", Path(list(runtime.__path__)[0]) / "include"]
    if not (headers[1] / "cuda_fp16.h").exists():
        pytest.skip("no CUDA headers beside the runtime wheel")
    source = f"""
#include <cupy/float16.cuh>
#include <cupy/bfloat16.cuh>
typedef {type_name} T;
extern "C" __global__ void merge(const T* o_part_, const float* lse_part_, const float* lse_acc_, float* out_) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const T o_part = o_part_[i];
    const float lse_part = lse_part_[i], lse_acc = lse_acc_[i];
    float& out = out_[i];
    {merge._FUSED_SOURCE}
}}
"""
    assert compile_cubin(source, name=f"merge_{type_name}", arch="sm_80", include_dirs=headers).cubin


def test_broadcast_metadata_counts_once_and_scales():
    """Batch/head dims the builders broadcast by stride 0 are read once; the work counts every row."""
    n = 4096
    one = host_mask(masks.sliding_window(300), n)
    wide = host_mask(masks.sliding_window(300), n, B=2, H=3)
    assert wide.kv_indices.strides[0] == 0 and wide.kv_indices.strides[1] == 0
    host = submask.host_metadata(wide)
    assert host.kv_indices.shape[:2] == (1, 1) and host.copies == 6 and host.batch_heads == (2, 3)
    a, b = planner.plan(one, 4, strategy="lpt", chunks_per_rank=2), planner.plan(wide, 4, strategy="lpt",
                                                                                chunks_per_rank=2)
    np.testing.assert_allclose(b.rank_work, 6 * a.rank_work)
    assert np.array_equal(a.need, b.need)
    part = steps.program(b, 1).steps[1].parts[0]
    assert part.mask.shape[:2] == (2, 3)
