"""A NumPy replay of every rank's program (omnicupy.distributed.steps) with the float64 reference
as the kernel, forward and backward, for the plan tests.

Messages are cut from the sender's shard by the sender's runs; K/V parts are computed on the
receiver's sub-masks; travelling queries are computed on the keys' rank under its ``guest``
sub-mask and answered: partial (o, lse) merged with the package's merge at the queries' runs,
dQ partials added there, dK/dV kept where the keys live. A wrong unit, run, offset, sub-mask or
routing decision makes the result differ from the whole-sequence reference.
"""
from __future__ import annotations

import numpy as np

from omnicupy import reference
from omnicupy.distributed import merge, sharding, steps


def cut(plan, owner, step_index, shards, which="send"):
    """What ``owner`` sends at ``step_index`` (its K/V message, or with ``which="q_send"`` its
    travelling queries), cut from each array of ``shards`` (lists indexed by rank) by its own runs."""
    message = getattr(steps.program(plan, owner).steps[step_index], which)
    return [np.concatenate([x[owner][:, :, o:o + n] for o, _, n in message.runs], axis=2) for x in shards]


def pair_backward(q, k, v, dout, out, lse, dense, scale):
    """float64 gradients of one (queries, keys) pair given the global out and lse of the queries
    (FlashAttention-2's decomposition); GQA: dK/dV summed over each kv head's query heads."""
    B, Hq, _, _ = q.shape
    group = Hq // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = scale * (q @ kk.swapaxes(-1, -2))
    allowed = np.broadcast_to(dense, s.shape)
    lse_safe = np.where(np.isfinite(lse), lse, 0)[..., None]
    p = np.where(allowed, np.exp(np.where(allowed, s, 0) - lse_safe), 0)
    dp = dout @ vv.swapaxes(-1, -2)
    delta = (dout * out).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    dq = scale * (ds @ kk)
    dk = scale * (ds.swapaxes(-1, -2) @ q)
    dv = p.swapaxes(-1, -2) @ dout
    fold = lambda x: x.reshape(B, -1, group, *x.shape[2:]).sum(axis=2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _shards(plan, *arrays):
    return [[sharding.shard(x, plan, r) for r in range(plan.world_size)] for x in arrays]


def _kv_message(plan, r, step, k_sh, v_sh):
    """The K/V rank r computes step ``step`` with: its own at step 0, the received message after,
    None when nothing arrives at that step."""
    if step.step == 0:
        return k_sh[r], v_sh[r]
    if step.recv is None:
        return None
    return cut(plan, step.src, step.step, (k_sh, v_sh))


def replay_forward(plan, q, k, v, scale):
    """Every rank's (out, lse) shard, float64."""
    world = plan.world_size
    q_sh, k_sh, v_sh = _shards(plan, q, k, v)
    outs = [np.zeros(x.shape) for x in q_sh]
    lses = [np.full(x.shape[:3], -np.inf) for x in q_sh]
    for r in range(world):
        for step in steps.program(plan, r).steps:
            kv = _kv_message(plan, r, step, k_sh, v_sh)
            if kv is None:
                continue
            k_msg, v_msg = kv
            for part in step.parts:
                rows = slice(part.q_start, part.q_start + part.q_len)
                o, l_ = reference.attention(q_sh[r][:, :, rows], k_msg, v_msg, part.mask.to_dense(), scale=scale,
                                            return_lse=True)
                merge.merge_into(outs[r][:, :, rows], lses[r][:, :, rows], o, l_, np)
    for r in range(world):  # travelling queries, answered by the keys' rank
        for step in steps.program(plan, r).remote_steps:
            if step.q_recv is None:
                continue
            (q_msg,) = cut(plan, step.src, step.step, (q_sh,), "q_send")
            o, l_ = reference.attention(q_msg, k_sh[r], v_sh[r], step.guest.to_dense(), scale=scale, return_lse=True)
            for own, at, n in steps.program(plan, step.src).steps[step.step].q_send.runs:
                merge.merge_into(outs[step.src][:, :, own:own + n], lses[step.src][:, :, own:own + n],
                                 o[:, :, at:at + n], l_[:, :, at:at + n], np)
    return list(zip(outs, lses))


def replay_backward(plan, q, k, v, dout, out, lse, scale):
    """(dq, dk, dv) of the whole sequence, gathered from every rank's shards."""
    world = plan.world_size
    q_sh, k_sh, v_sh, do_sh, o_sh, l_sh = _shards(plan, q, k, v, dout, out, lse)
    dq = [np.zeros_like(x) for x in q_sh]
    dk = [np.zeros_like(x) for x in k_sh]
    dv = [np.zeros_like(x) for x in v_sh]
    for r in range(world):
        for step in steps.program(plan, r).steps:
            if step.step and step.q_recv is not None:  # queries of step.src against the local keys
                q_m, do_m, o_m, l_m = cut(plan, step.src, step.step, (q_sh, do_sh, o_sh, l_sh), "q_send")
                g_q, g_k, g_v = pair_backward(q_m, k_sh[r], v_sh[r], do_m, o_m, l_m, step.guest.to_dense(), scale)
                dk[r] += g_k
                dv[r] += g_v
                for own, at, n in steps.program(plan, step.src).steps[step.step].q_send.runs:
                    dq[step.src][:, :, own:own + n] += g_q[:, :, at:at + n]
            kv = _kv_message(plan, r, step, k_sh, v_sh)
            if kv is None:
                continue
            k_msg, v_msg = kv
            for part in step.parts:
                rows = slice(part.q_start, part.q_start + part.q_len)
                g_q, g_k, g_v = pair_backward(q_sh[r][:, :, rows], k_msg, v_msg, do_sh[r][:, :, rows],
                                              o_sh[r][:, :, rows], l_sh[r][:, :, rows], part.mask.to_dense(), scale)
                dq[r][:, :, rows] += g_q
                if step.step == 0:
                    dk[r] += g_k
                    dv[r] += g_v
                    continue
                for own, at, n in steps.program(plan, step.src).steps[step.step].send.runs:  # back to the owner
                    dk[step.src][:, :, own:own + n] += g_k[:, :, at:at + n]
                    dv[step.src][:, :, own:own + n] += g_v[:, :, at:at + n]
    return [sharding.gather_shards(x, plan) for x in (dq, dk, dv)]


def check_replay(plan, dense, *, heads=2, kv_heads=2, seed=0, head_dim=16, scale=0.25, where="", batch=1):
    """Replay forward and backward on seeded inputs and compare with the whole-sequence reference."""
    n = plan.seq_len
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, n, head_dim))
    k, v = (rng.standard_normal((batch, kv_heads, n, head_dim)) for _ in range(2))
    dout = rng.standard_normal((batch, heads, n, head_dim))
    want_o, want_lse = reference.attention(q, k, v, dense, scale=scale, return_lse=True)
    parts = replay_forward(plan, q, k, v, scale)
    out = sharding.gather_shards([o for o, _ in parts], plan)
    lse = sharding.gather_shards([x for _, x in parts], plan)
    assert reference.relative_error(out, want_o) < 1e-6, f"out: {where} seed {seed}"  # merged in float32
    finite = np.isfinite(want_lse)
    assert np.array_equal(finite, np.isfinite(lse)), f"empty rows: {where} seed {seed}"
    assert np.allclose(lse[finite], want_lse[finite], rtol=1e-6), f"lse: {where} seed {seed}"
    got = replay_backward(plan, q, k, v, dout, want_o, want_lse, scale)
    want = pair_backward(q, k, v, dout, want_o, want_lse, dense, scale)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        assert reference.relative_error(g, w) < 1e-10, f"{what}: {where} seed {seed}"
