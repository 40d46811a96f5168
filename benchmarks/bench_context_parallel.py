"""Context parallelism on 2 or 4 GPUs against one GPU: forward and forward+backward time, speedup,
bytes sent per rank and the fraction of communication hidden under compute, for issue 39's mask
families (tests/support/distributed_cases.py).

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_context_parallel.py --gpus 4 --out cp4.json    # every family
    NCCL_NVLS_ENABLE=0 python benchmarks/bench_context_parallel.py --gpus 2 --out cp2.json
    python benchmarks/bench_context_parallel.py --masks causal,global_window --n 65536 --repeats 3

Spawns one process per GPU itself (no launcher needed; NVLink multicast stays off). Per mask, B 1,
H 16, D 128, fp16 by default: correctness first (the distributed output, and gradients when
omnicupy.attention_backward exists, against the single-GPU call; a failing case is not timed),
then CUDA-event timings, median of --repeats, each the slowest rank's:
- 1 GPU: omnicupy.attention (and attention_backward) on the whole sequence, on every rank's GPU at once;
- distributed: distributed.attention (and attention_backward) on the shards;
- compute only: the distributed call's own step loop with the messages already in place (no transfer);
- transfers only: the same NCCL transfers with no compute;
hidden = (compute + transfers - distributed) / transfers, clipped to [0, 1]. The scaling model
(omnicupy/distributed/model.py), calibrated with the measured one-GPU rate and link bandwidth,
predicts the distributed time beside the measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue as queue_module
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from omnicupy import arrays  # noqa: E402  (CuPy through it: nothing here imports CuPy before a GPU is known)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the families live beside the tests
from distributed_cases import FAMILIES, family_mod, random_blocks  # noqa: E402

MASKS = FAMILIES
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}


def mask_mod(name: str, n: int):
    """The mask_mod of a family (tests/support/distributed_cases.py: 64 global tokens, 2048 windows, ...)."""
    return family_mod(name, n)


def build_mask(name: str, n: int):
    """The BlockMask of ``name`` at length n (built where the builders choose: the GPU here)."""
    from omnicupy import BlockMask

    if name.startswith("random_"):
        return random_blocks(n, int(name.split("_")[1]) / 100)
    return BlockMask.from_mask_mod(mask_mod(name, n), None, None, n, n)


# ------------------------------------------------------------------------------ one rank
class Timer:
    """Median over repeats of the slowest rank's CUDA-event time of ``fn()`` (one warm-up call)."""

    def __init__(self, comm, repeats: int) -> None:
        self.comm, self.repeats = comm, repeats

    def __call__(self, fn) -> float:
        cp = arrays.cupy_module()

        fn()
        stream = cp.cuda.get_current_stream()
        times = []
        for _ in range(self.repeats):
            self.comm.barrier()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            slowest = cp.asarray([cp.cuda.get_elapsed_time(start, end)], dtype=cp.float64)
            self.comm.all_reduce(slowest, "max")
            times.append(float(slowest.get()[0]))
        return statistics.median(times)


class Resident:
    """Stands in for KVExchange with every message already in place: the distributed call's own
    step loop (sharded_attention.forward_steps / backward_steps) with no transfer at all."""

    def __init__(self, prog, messages: dict, returns: dict, returned_shape, guests: dict, answers: dict) -> None:
        cp = arrays.cupy_module()

        self.messages, self.returns, self.guests, self._answers = messages, returns, guests, answers
        self.dk = self.dv = None
        if returned_shape is not None:
            self.dk, self.dv = (cp.zeros(returned_shape, dtype=cp.float32) for _ in range(2))

    def guest(self, s):
        return self.guests[s]

    def answer_buffers(self, s):
        return self._answers[("out", s)]

    def answers(self, s):
        return self._answers[("in", s)]

    def post(self, s):
        pass

    def kv(self, s):
        return self.messages[s]

    def done(self, s):
        pass

    def return_buffers(self, s):
        return self.returns[s]

    def post_return(self, s):
        pass

    def finish(self):
        pass


def transfers_only(comm, prog, k, v, *, returns: bool, queries: tuple = ()):
    """The distributed call's NCCL transfers with no compute (partials and answers sent as they lie)."""
    from omnicupy.distributed.exchange import KVExchange

    exchange = KVExchange(comm, prog, k, v, returns=returns, queries=queries)
    exchange.post(1)
    for step in prog.remote_steps:
        exchange.post(step.step + 1)
        if step.recv is not None:
            exchange.kv(step.step)
            if returns:
                exchange.return_buffers(step.step)
        if step.q_recv is not None:
            exchange.guest(step.step)
            exchange.answer_buffers(step.step)
        if step.recv is not None or step.q_recv is not None:
            exchange.done(step.step)
        exchange.post_return(step.step)
    exchange.finish()


def relative(a, b) -> float:
    cp = arrays.cupy_module()

    a, b = a.astype(cp.float32), b.astype(cp.float32)
    if not bool(cp.all(cp.isfinite(a))):
        return float("inf")
    return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))


def run_mask(name: str, args, comm) -> dict:
    cp = arrays.cupy_module()

    import omnicupy
    from omnicupy import distributed as dist
    from omnicupy.distributed import model

    n, heads, kv_heads, d = args.n, args.heads, args.kv_heads or args.heads, args.head_dim
    dtype = {"fp16": np.float16, "bf16": arrays.BFLOAT16}[args.dtype]
    bm = build_mask(name, n)
    plan = dist.plan(bm, comm.size, strategy=args.strategy, route=args.route, heads=(heads, kv_heads))
    prog = dist.program(plan, comm.rank)
    rng = np.random.default_rng(args.seed)
    q = cp.asarray(rng.standard_normal((1, heads, n, d)).astype(dtype))
    k, v = (cp.asarray(rng.standard_normal((1, kv_heads, n, d)).astype(dtype)) for _ in range(2))
    dout = cp.asarray(rng.standard_normal((1, heads, n, d)).astype(dtype))
    q_r, k_r, v_r, do_r = (dist.shard(x, plan, comm.rank) for x in (q, k, v, dout))
    has_backward = getattr(omnicupy, "attention_backward", None) is not None
    shapes = dict(batch=1, kv_heads=kv_heads, head_dim=d, itemsize=np.dtype(dtype).itemsize)
    row = dict(mask=name, n=n, heads=heads, kv_heads=kv_heads, head_dim=d, dtype=args.dtype, seed=args.seed,
               plan=f"{plan.strategy} x{plan.chunks_per_rank}, {plan.schedule}, {plan.route}", imbalance=plan.imbalance,
               bytes_sent_forward=max(plan.bytes_sent(r, **shapes, q_heads=heads) for r in range(comm.size)),
               bytes_sent_backward=max(plan.bytes_sent(r, **shapes, q_heads=heads, backward=True)
                                       for r in range(comm.size)),  # the backward pass alone
               kv_bytes=2 * n * kv_heads * d * np.dtype(dtype).itemsize)

    # correctness first
    want, want_lse = omnicupy.attention(q, k, v, bm, return_lse=True)
    out_r, lse_r = dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True)
    row["error_forward"] = relative(dist.unshard(out_r, plan, comm), want)
    if has_backward:
        grads = dist.attention_backward(do_r, q_r, k_r, v_r, out_r, lse_r, plan, comm)
        wants = omnicupy.attention_backward(dout, q, k, v, want, want_lse, bm)
        row["error_backward"] = max(relative(dist.unshard(g, plan, comm), w) for g, w in zip(grads, wants))
    tol = TOLERANCE[args.dtype]
    errors = cp.asarray([row["error_forward"], row.get("error_backward", 0.0)], dtype=cp.float64)
    comm.all_reduce(errors, "max")
    row["correct"] = bool(float(errors.max().get()) <= tol)
    if not row["correct"]:
        return row

    timer = Timer(comm, args.repeats)
    from omnicupy.distributed.sharded_attention import backward_steps, forward_steps

    def message(length):
        return cp.asarray(rng.standard_normal((1, kv_heads, length, d)).astype(dtype))

    messages = {s.step: (message(s.recv.length), message(s.recv.length)) for s in prog.remote_steps if s.recv}
    returns = {s.step: (cp.empty_like(k_), cp.empty_like(v_)) for s in prog.remote_steps if s.recv
               for k_, v_ in [messages[s.step]]}
    returned_shape = (1, kv_heads, prog.returned_len, d) if prog.returned_len else None

    def rows(length, *, lse=False):
        shape = (1, heads, length) + (() if lse else (d,))
        return cp.zeros(shape, cp.float32) if lse else cp.asarray(rng.standard_normal(shape).astype(dtype))

    def resident(backward):
        guests = {s.step: (rows(s.q_recv.length),) + ((rows(s.q_recv.length), rows(s.q_recv.length),
                                                        rows(s.q_recv.length, lse=True)) if backward else ())
                  for s in prog.remote_steps if s.q_recv}
        answers = {}
        for s in prog.remote_steps:
            for key, msg in (("out", s.q_recv), ("in", s.q_send)):
                if msg is not None:
                    answers[(key, s.step)] = ((rows(msg.length),) if backward else
                                              (rows(msg.length), rows(msg.length, lse=True)))
        return Resident(prog, messages, returns, returned_shape if backward else None, guests, answers)

    def compute_only(backward: bool = False):
        o, l_ = forward_steps(q_r, k_r, v_r, prog, resident(False))
        if backward:
            backward_steps(do_r, q_r, k_r, v_r, o, l_, prog, resident(True), omnicupy.attention_backward, {})

    row["single_forward_ms"] = timer(lambda: omnicupy.attention(q, k, v, bm, return_lse=True))
    row["forward_ms"] = timer(lambda: dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True))
    row["compute_forward_ms"] = timer(compute_only)
    has_q = any(s.q_send is not None or s.q_recv is not None for s in prog.remote_steps)
    fwd_q = (q_r,) if has_q else ()
    bwd_q = (q_r, do_r, q_r, cp.zeros(q_r.shape[:3], cp.float32)) if has_q else ()
    row["transfer_forward_ms"] = timer(lambda: transfers_only(comm, prog, k_r, v_r, returns=False, queries=fwd_q))
    if has_backward:
        def single_both():
            o, l_ = omnicupy.attention(q, k, v, bm, return_lse=True)
            return omnicupy.attention_backward(dout, q, k, v, o, l_, bm)

        def dist_both():
            o, l_ = dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True)
            return dist.attention_backward(do_r, q_r, k_r, v_r, o, l_, plan, comm)

        def transfers_both():
            transfers_only(comm, prog, k_r, v_r, returns=False, queries=fwd_q)
            transfers_only(comm, prog, k_r, v_r, returns=True, queries=bwd_q)

        row["single_both_ms"] = timer(single_both)
        row["both_ms"] = timer(dist_both)
        row["compute_both_ms"] = timer(lambda: compute_only(backward=True))
        row["transfer_both_ms"] = timer(transfers_both)
    for kind in ("forward", "both"):
        if f"{kind}_ms" not in row:
            continue
        single_key = f"single_{kind}_ms"
        row[f"speedup_{kind}"] = row[single_key] / row[f"{kind}_ms"]
        transfer = row[f"transfer_{kind}_ms"]
        hidden = (row[f"compute_{kind}_ms"] + transfer - row[f"{kind}_ms"]) / transfer if transfer > 0 else 1.0
        row[f"hidden_{kind}"] = float(np.clip(hidden, 0.0, 1.0))

    # the scaling model with this machine's measured rate and bandwidth, for the same plan
    pairs_flops = 4 * heads * d * float(plan.exchange_work.sum()) * plan.q_block_size * plan.kv_block_size / 2
    measured_tflops = pairs_flops / (row["single_forward_ms"] * 1e-3) / 1e12
    sent = row["bytes_sent_forward"]
    link = sent / (row["transfer_forward_ms"] * 1e-3) / 1e9 if sent and row["transfer_forward_ms"] else None
    both_tflops = None
    backward_ms = row.get("single_both_ms", 0.0) - row["single_forward_ms"]
    if has_backward and backward_ms > 0:
        both_tflops = 2.5 * pairs_flops / (backward_ms * 1e-3) / 1e12
    machine = model.calibrated(model.H200_NVLINK_IB, forward_tflops=measured_tflops, nvlink_gbs=link,
                               backward_tflops=both_tflops)
    row["measured_forward_tflops"], row["measured_link_gbs"] = measured_tflops, link
    model_shapes = model.Shapes(1, heads, kv_heads, d, np.dtype(dtype).itemsize)
    row["model_forward_ms"] = model.predict(plan, model_shapes, machine).distributed_ms
    if has_backward:
        row["model_both_ms"] = model.predict(plan, model_shapes, machine, backward=True).distributed_ms
    return row


def worker(rank: int, world: int, port: int, args, answers) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port - 1), OMNICUPY_NCCL_PORT=str(port), NCCL_NVLS_ENABLE="0")
    rows = []
    try:
        from omnicupy import distributed as dist

        comm = dist.init()
        for name in args.masks:
            try:
                rows.append(run_mask(name, args, comm))
            except Exception:  # noqa: BLE001 - reported in the table
                rows.append(dict(mask=name, error=traceback.format_exc()))
        comm.barrier()
        comm.close()
    except Exception:  # noqa: BLE001
        rows.append(dict(mask="(start-up)", error=traceback.format_exc()))
    answers.put((rank, rows))


# ----------------------------------------------------------------------------- the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(row: dict, key: str, spec: str = ".2f", scale: float = 1.0) -> str:
    value = row.get(key)
    return "-" if value is None else format(value * scale, spec)


def table(rows: list[dict]) -> str:
    """The short table printed last: speedups, hidden communication and the busiest sender's bytes."""
    head = ("| mask | plan | fwd speedup | f+b speedup | model f+b | hidden fwd / f+b | "
            "max sent fwd / bwd (% of K+V) | error |")
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mask']} | failed: {r['error'].strip().splitlines()[-1]} |" + " |" * 6)
            continue
        sent = f"{100 * r['bytes_sent_forward'] / r['kv_bytes']:.1f} / {100 * r['bytes_sent_backward'] / r['kv_bytes']:.1f}"
        model = (f"{r['single_both_ms'] / r['model_both_ms']:.2f}x" if r.get("model_both_ms") and r.get("single_both_ms")
                 else "-")
        hidden = f"{_fmt(r, 'hidden_forward', '.0%')} / {_fmt(r, 'hidden_both', '.0%')}"
        err = f"{max(r['error_forward'], r.get('error_backward', 0.0)):.1e}" + ("" if r["correct"] else " FAILED")
        lines.append(" | ".join([f"| {r['mask']}", r["plan"], _fmt(r, "speedup_forward"), _fmt(r, "speedup_both"),
                                 model, hidden, sent, err]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--masks", type=lambda s: s.split(","), default=list(MASKS), help=",".join(MASKS))
    parser.add_argument("--n", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--strategy", choices=["contiguous", "zigzag", "lpt"], default=None,
                        help="pin the planner's assignment (default: the planner chooses)")
    parser.add_argument("--route", choices=["auto", "keys", "queries"], default="auto",
                        help="what travels: the planner's choice per pair (auto), K/V only, or queries only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=470, help="seconds for the whole run (8 minutes with start-up)")
    parser.add_argument("--out", "--json", dest="json", type=Path, default=None, help="also write the rows here (JSON)")
    args = parser.parse_args(argv)
    bad = [m for m in args.masks if m not in MASKS]
    if bad:
        parser.error(f"unknown masks {bad}; choose from {MASKS}")
    count = arrays.cupy_module().cuda.runtime.getDeviceCount() if arrays.gpu_available() else 0
    if count < args.gpus:
        print(f"bench_context_parallel.py needs {args.gpus} GPUs; {count} usable here, so nothing was run.")
        return 0
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, args.gpus, port, args, answers), daemon=True) for r in range(args.gpus)]
    for p in procs:
        p.start()
    found, deadline = {}, time.monotonic() + args.timeout
    try:
        while len(found) < args.gpus:
            try:
                rank, rows = answers.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                print(f"timed out after {args.timeout} s with ranks {sorted(found)} done")
                return 1
            found[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    rows = found[0]
    for rank, other in found.items():
        for r in other:
            if "error" in r and rank:
                print(f"rank {rank}, {r['mask']}:\n{r['error']}")
    for r in rows:
        if "error" in r:
            print(f"rank 0, {r['mask']}:\n{r['error']}")
    if args.json:
        meta = dict(host=platform.node(), python=platform.python_version(), argv=sys.argv[1:])
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    print(f"\nB=1 H={args.heads} Hkv={args.kv_heads or args.heads} D={args.head_dim} {args.dtype} N={args.n}, "
          f"{args.gpus} GPUs, median of {args.repeats}; hidden = (compute + transfers - distributed) / transfers")
    print(table(rows))
    return 0 if all(r.get("correct", False) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
