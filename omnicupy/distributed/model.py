"""The scaling model: predicted time and efficiency of a plan from per-step compute and link bandwidth.

Knows: a ShardPlan's work between every pair of ranks (``exchange_work``) and the tokens each rank
receives at each step, and a Machine's rates (attention FLOP/s per GPU, bytes/s per link, merge
traffic through HBM, a fixed cost per step). Does not know GPUs: it is arithmetic, so the docs'
table (``python -m omnicupy.distributed.model``) and the benchmark's prediction come from it.

Timeline of the ring schedule (exchange.py), with every step's transfer taken as a barrier across
ranks (conservative): the transfer of step s starts when the transfer of step s - 1 is done and
every rank has finished computing step s - 2 (its receive slot is free); it lasts as long as the
busiest rank's outgoing bytes at that step over its link (NVLink inside a node, the network
between nodes). A rank computes step s once step s's data is in and step s - 1 is computed. The
local step needs no transfer. The backward is the same walk with 2.5x the FLOPs (the project's
backward count) and, at each step, the dK/dV partials of the previous step going back as well.

Efficiency = (one GPU's time) / (W x the distributed time); one GPU's time is the whole mask's
FLOPs at the same rate, so load imbalance, exposed communication and per-step costs all show.

Travelling queries (routing.py) add, at their step, the Q rows (Q, dO and O in the backward) and
the answers (partial O and LSE, or dQ) to that step's bytes; their work counts on the keys' rank
(``exchange_work`` is the work each rank executes).

Head parallelism (Ulysses): ``h`` ranks exchange heads by all-to-all so that each computes the whole
sequence for Hq / h query heads and Hkv / h kv heads (h divides Hkv: a kv head is never split, so
GQA bounds h by the kv heads), then send the outputs back. Nothing overlaps the two all-to-alls;
the compute is exactly balanced. ``W = h x s`` combines it with a sequence plan over s ranks
(each group of h inside one node). ``best_layout`` predicts every (h, s) and keeps the fastest.
All figures are predictions of this arithmetic, not measurements.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .planner import ShardPlan

#: FLOPs per allowed (query, key) pair: two matmuls of 2 * D each (the project's effective count).
FORWARD_FLOPS_PER_PAIR_PER_DIM = 4
BACKWARD_FLOP_RATIO = 2.5
#: Merging one partial (merge.py's fused kernel): read and write the float32 sum, read the 2-byte part.
MERGE_BYTES_PER_ELEMENT = 4 + 4 + 2
#: Once per call, per touched row: the local result into the float32 accumulator and back.
ACCUMULATOR_BYTES_PER_ELEMENT = (2 + 4) + (4 + 2)


@dataclass(frozen=True)
class Machine:
    """Rates the model assumes; replace them by measured ones (bench_context_parallel.py prints them)."""

    name: str
    forward_tflops: float  # effective attention TFLOP/s of one GPU, forward
    backward_tflops: float  # effective, counting 2.5x the forward's FLOPs
    nvlink_gbs: float  # bytes/s one GPU sends to peers inside its node, GB/s
    network_gbs: float  # bytes/s one GPU sends to other nodes (its NIC), GB/s
    gpus_per_node: int
    hbm_tbs: float  # for the merges
    step_us: float  # launches, events and NCCL latency per step


#: Assumed figures for lent H200s (to be replaced by the benchmark's measured ones): forward near
#: the project's single-GPU rates at D = 128 (docs/performance.md), NCCL send/recv at 200 GB/s over
#: NVLink (the all-reduce bus bandwidth measured 230-300 GB/s), 400 Gb/s InfiniBand per GPU.
H200_NVLINK_IB = Machine("8x H200 per NVLink host, ~50 GB/s per GPU between hosts",
                         forward_tflops=450.0, backward_tflops=380.0, nvlink_gbs=200.0, network_gbs=50.0,
                         gpus_per_node=8, hbm_tbs=4.0, step_us=30.0)


@dataclass(frozen=True)
class Shapes:
    batch: int = 1
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    itemsize: int = 2


@dataclass(frozen=True)
class Prediction:
    world_size: int
    single_ms: float  # one GPU, the whole mask
    distributed_ms: float  # the slowest rank
    compute_ms: float  # the busiest rank's compute alone
    comm_ms: float  # all transfers back to back
    hidden: float  # fraction of the transfer time under compute

    @property
    def speedup(self) -> float:
        return self.single_ms / self.distributed_ms if self.distributed_ms else float("inf")

    @property
    def efficiency(self) -> float:
        return self.speedup / self.world_size


def _pair_flops(plan: ShardPlan, shapes: Shapes) -> float:
    """FLOPs of one unit of block work: a weight-2 (FULL) block is q_block x kv_block allowed pairs."""
    pairs_per_work = plan.q_block_size * plan.kv_block_size / 2
    return pairs_per_work * FORWARD_FLOPS_PER_PAIR_PER_DIM * shapes.head_dim * shapes.batch * shapes.heads


def _link_gbs(machine: Machine, a: int, b: int) -> float:
    same_node = a // machine.gpus_per_node == b // machine.gpus_per_node
    return machine.nvlink_gbs if same_node else machine.network_gbs


def predict(plan: ShardPlan, shapes: Shapes = Shapes(), machine: Machine = H200_NVLINK_IB, *,
            backward: bool = False) -> Prediction:
    """Predicted times of ``plan`` (forward, or forward+backward with ``backward``)."""
    world = plan.world_size
    # Seconds per forward FLOP; the backward adds 2.5x the forward's FLOPs at its own effective rate.
    per_flop = 1 / machine.forward_tflops + (BACKWARD_FLOP_RATIO / machine.backward_tflops if backward else 0.0)
    flops_per_work = _pair_flops(plan, shapes)
    seconds = lambda work: work * flops_per_work * per_flop / 1e12  # noqa: E731
    single = seconds(float(plan.exchange_work.sum()))
    per_token = 2 * shapes.batch * shapes.kv_heads * shapes.head_dim * shapes.itemsize
    q_row = shapes.batch * shapes.heads * shapes.head_dim * shapes.itemsize
    lse = shapes.batch * shapes.heads * 4
    # per travelling query token: sent (Q; Q, dO, O, LSE) and answered (O, LSE; dQ)
    q_out = q_row + ((3 * q_row + lse) if backward else 0)
    q_back = q_row + lse + (q_row if backward else 0)
    merge_per_row = MERGE_BYTES_PER_ELEMENT * shapes.batch * shapes.heads * shapes.head_dim / (machine.hbm_tbs * 1e12)
    step_s = machine.step_us * 1e-6
    compute = np.zeros((world, world))  # [rank, step]
    transfer = np.zeros(world)  # [step]
    for s in range(world):
        for r in range(world):
            src = (r - s) % world
            work = plan.exchange_work[r, src]
            # a remote step merges the rows that attend to the message (steps.py's parts)
            merge = merge_per_row * plan.rows_attending(r, src) if s else 0.0
            compute[r, s] = seconds(work) + (merge + step_s if work and s else 0.0)
            if s:
                received = int(plan.unit_tokens[plan.recv_units(r, s)].sum())
                sent = int(plan.unit_tokens[plan.send_units(r, s)].sum())
                q_sent = int(plan.unit_tokens[plan.q_send_units(r, s)].sum())
                q_got = int(plan.unit_tokens[plan.q_recv_units(r, s)].sum())
                kv_factor = 2 if backward else 1  # + the dK/dV returns
                moved = max(received * per_token * kv_factor + q_got * q_out + q_sent * q_back,
                            sent * per_token * kv_factor + q_sent * q_out + q_got * q_back)
                transfer[s] = max(transfer[s], moved / (_link_gbs(machine, r, src) * 1e9) + step_s)
    for r in range(world):  # the compact accumulator's fill and write-back, at most the whole shard
        touched = min(plan.local_len(r), sum(plan.rows_attending(r, (r - s) % world) for s in range(1, world)))
        compute[r, -1] += touched * merge_per_row * ACCUMULATOR_BYTES_PER_ELEMENT / MERGE_BYTES_PER_ELEMENT
    if plan.schedule == "allgather" and world > 1:
        # One all-gather: (W - 1) padded shards through each GPU's slowest link, behind the local step.
        longest = max(plan.local_len(r) for r in range(world))
        slow = min(_link_gbs(machine, 0, r) for r in range(1, world))
        gather = (world - 1) * longest * per_token / (slow * 1e9)
        returns = (world - 1) * longest * per_token / (slow * 1e9) if backward else 0.0
        done = np.maximum(compute[:, 0], gather) + compute[:, 1:].sum(axis=1) + returns
        comm = gather + returns
    else:
        comm_end = np.zeros(world)
        done_at = np.zeros((world, world))  # [rank, step]: compute of that step finished
        done_at[:, 0] = compute[:, 0]
        for s in range(1, world):
            slot_free = done_at[:, s - 2].max() if s >= 2 else 0.0
            comm_end[s] = max(comm_end[s - 1], slot_free) + transfer[s]
            done_at[:, s] = np.maximum(done_at[:, s - 1], comm_end[s]) + compute[:, s]
        done = done_at[:, -1]
        comm = float(transfer.sum())
    busiest = float(compute.sum(axis=1).max())
    total = float(done.max())
    hidden = 1.0 if comm == 0 else float(np.clip(1 - (total - busiest) / comm, 0.0, 1.0))
    return Prediction(world, single * 1e3, total * 1e3, busiest * 1e3, comm * 1e3, hidden)


@dataclass(frozen=True)
class Layout:
    """One way to spread the work: ``heads`` ranks per head group (1: no head parallelism) times
    ``seq`` ranks of a sequence plan; its prediction and the bytes the busiest rank sends."""

    heads: int
    seq: int
    prediction: Prediction
    bytes_per_rank: int

    @property
    def name(self) -> str:
        if self.heads == 1:
            return f"sequence x{self.seq}"
        return f"heads x{self.heads}" + (f" . sequence x{self.seq}" if self.seq > 1 else "")


def head_degrees(world: int, kv_heads: int) -> list[int]:
    """Head-parallel degrees h that divide both the world and the kv heads (h = 1 included)."""
    return [h for h in range(1, world + 1) if world % h == 0 and kv_heads % h == 0]


def all_to_all_bytes(tokens: int, shapes: Shapes, degree: int, *, backward: bool) -> int:
    """Bytes one rank sends in the head all-to-alls of one pass over ``tokens`` of its sequence:
    (h - 1) / h of its Q, K, V out and of the outputs back (backward: dO, O, LSE out and dQ, dK,
    dV back, Q, K, V kept from the forward)."""
    row = shapes.batch * shapes.head_dim * shapes.itemsize
    q, kv, lse = shapes.heads * row, 2 * shapes.kv_heads * row, shapes.batch * shapes.heads * 4
    per_token = (2 * q + lse + q + kv) if backward else (q + kv + q + lse)
    return tokens * per_token * (degree - 1) // degree


def best_layout(make_plan, seq_len: int, world: int, shapes: Shapes = Shapes(),
                machine: Machine = H200_NVLINK_IB, *, backward: bool = True) -> list[Layout]:
    """Every layout ``heads x seq = world`` (heads bounded by the kv heads), fastest first.
    ``make_plan(ranks, heads)`` returns the sequence plan over ``ranks`` ranks (heads = (Hq, Hkv) of
    a head group)."""
    layouts = []
    for h in head_degrees(world, shapes.kv_heads):
        seq = world // h
        group = replace(shapes, heads=shapes.heads // h, kv_heads=shapes.kv_heads // h)
        plan = make_plan(seq, (group.heads, group.kv_heads))
        # sequence rank i of a head group sits at world rank i * h: h times fewer of them share a node
        spread = replace(machine, gpus_per_node=max(1, machine.gpus_per_node // h))
        base = predict(plan, group, spread, backward=backward)
        tokens = seq_len // world
        a2a = all_to_all_bytes(tokens, shapes, h, backward=False) + (
            all_to_all_bytes(tokens, shapes, h, backward=True) if backward else 0)
        link = machine.nvlink_gbs if h <= machine.gpus_per_node else machine.network_gbs
        a2a_ms = a2a / (link * 1e9) * 1e3 + (2 * machine.step_us * 1e-3 if h > 1 else 0.0)
        # the sequence plan's single-GPU time covers 1 / h of the heads: scale it back to the whole
        pred = Prediction(world, base.single_ms * h, base.distributed_ms + a2a_ms, base.compute_ms,
                          base.comm_ms + a2a_ms, base.hidden * base.comm_ms / (base.comm_ms + a2a_ms)
                          if base.comm_ms + a2a_ms else 1.0)
        kv_shapes = dict(batch=group.batch, kv_heads=group.kv_heads, head_dim=group.head_dim,
                         itemsize=group.itemsize, q_heads=group.heads)
        seq_bytes = max(plan.bytes_sent(r, **kv_shapes) + (plan.bytes_sent(r, **kv_shapes, backward=True)
                                                           if backward else 0) for r in range(seq))
        layouts.append(Layout(h, seq, pred, seq_bytes + a2a))
    return sorted(layouts, key=lambda lay: lay.prediction.distributed_ms)


def family_table(names=None, lengths=(131072, 1048576), worlds=(2, 4, 8, 16, 32, 64), shapes: Shapes = Shapes(),
                 machine: Machine = H200_NVLINK_IB, blocks: int = 512):
    """Predicted forward+backward efficiency of every family (families.py) at each length and world
    size, with the fastest layout and the busiest rank's bytes; plans on ``blocks`` blocks per side.
    Yields one row (a dict) at a time."""
    from . import families
    from .planner import plan as make_plan

    for name in names or families.NAMES:
        for n in lengths:
            bm = families.block_mask(name, n, n // blocks)
            for w in worlds:
                if n // (n // blocks) < 2 * w:
                    continue
                layouts = best_layout(lambda ranks, heads: make_plan(bm, ranks, heads=heads), n, w, shapes, machine)
                best, seq_only = layouts[0], next(lay for lay in layouts if lay.heads == 1)
                yield dict(family=name, n=n, world=w, layout=best.name, efficiency=best.prediction.efficiency,
                           sequence_efficiency=seq_only.prediction.efficiency, mib_per_rank=best.bytes_per_rank / 2**20,
                           sequence_mib_per_rank=seq_only.bytes_per_rank / 2**20)


def calibrated(machine: Machine, *, forward_tflops: Optional[float] = None, backward_tflops: Optional[float] = None,
               nvlink_gbs: Optional[float] = None) -> Machine:
    """``machine`` with measured rates in place of assumed ones (None keeps the assumption)."""
    values = dict(forward_tflops=forward_tflops, backward_tflops=backward_tflops, nvlink_gbs=nvlink_gbs)
    return replace(machine, **{k: v for k, v in values.items() if v is not None})


def causal_table(lengths=(131072, 262144, 524288, 1048576), worlds=(8, 16, 32, 64), shapes: Shapes = Shapes(),
                 machine: Machine = H200_NVLINK_IB) -> list[dict]:
    """Predicted efficiency of causal attention (zigzag plans) for the docs' table. The plans use
    coarse blocks (N / 512 tokens) so that they build in a moment; the work fractions barely move."""
    from .. import BlockMask
    from .planner import plan as make_plan

    rows = []
    for n in lengths:
        block = n // 512
        bm = BlockMask.causal(n, n, q_block_size=block, kv_block_size=block)
        for w in worlds:
            p = make_plan(bm, w)
            fwd, both = predict(p, shapes, machine), predict(p, shapes, machine, backward=True)
            rows.append(dict(n=n, world=w, tokens_per_rank=n // w, forward=fwd, backward=both))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the scaling model's table for causal attention.")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--forward-tflops", type=float, default=None)
    parser.add_argument("--backward-tflops", type=float, default=None)
    parser.add_argument("--nvlink-gbs", type=float, default=None)
    parser.add_argument("--families", action="store_true",
                        help="every family of issue 39 (families.py), 2-64 GPUs, 128k and 1M tokens, best layout")
    args = parser.parse_args(argv)
    shapes = Shapes(heads=args.heads, kv_heads=args.kv_heads or args.heads)
    machine = calibrated(H200_NVLINK_IB, forward_tflops=args.forward_tflops, backward_tflops=args.backward_tflops,
                         nvlink_gbs=args.nvlink_gbs)
    if args.families:
        print(f"PREDICTIONS of the scaling model, not measurements. {machine.name}; NVLink {machine.nvlink_gbs:g} "
              f"GB/s per GPU, {machine.network_gbs:g} GB/s between hosts; B={shapes.batch} H={shapes.heads} "
              f"Hkv={shapes.kv_heads} D={shapes.head_dim} fp16, forward+backward; MiB: the busiest rank, both passes")
        print("| family | N | GPUs | best layout | efficiency | MiB/rank | sequence-only efficiency | MiB/rank |")
        print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for r in family_table(shapes=shapes, machine=machine):
            print(f"| {r['family']} | {r['n']} | {r['world']} | {r['layout']} | {r['efficiency']:.2f} | "
                  f"{r['mib_per_rank']:.0f} | {r['sequence_efficiency']:.2f} | {r['sequence_mib_per_rank']:.0f} |",
                  flush=True)
        return 0
    print(f"{machine.name}; B={shapes.batch} H={shapes.heads} Hkv={shapes.kv_heads} D={shapes.head_dim} fp16")
    print("| N | GPUs | tokens/GPU | fwd ms | fwd efficiency | fwd hidden | fwd+bwd ms | fwd+bwd efficiency | "
          "fwd+bwd hidden |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in causal_table(shapes=shapes, machine=machine):
        f, b = row["forward"], row["backward"]
        print(f"| {row['n']} | {row['world']} | {row['tokens_per_rank']} | {f.distributed_ms:.1f} | {f.efficiency:.2f} | "
              f"{f.hidden:.2f} | {b.distributed_ms:.1f} | {b.efficiency:.2f} | {b.hidden:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["Machine", "Shapes", "Prediction", "Layout", "predict", "calibrated", "causal_table", "family_table",
           "best_layout", "head_degrees", "all_to_all_bytes", "H200_NVLINK_IB"]
