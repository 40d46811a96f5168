"""Context parallelism: one attention over a sequence sharded across GPUs, one process per GPU.

    torchrun --nproc-per-node 2 examples/context_parallel.py
    mpirun -n 2 python examples/context_parallel.py
    torchrun --nproc-per-node 2 examples/context_parallel.py --mask document --n 65536

Every rank builds the same mask and the same plan (which tokens it owns, which K/V it needs from
whom), takes its shard of q, k and v, and calls ``distributed.attention``; K/V travel over NCCL
on a stream of their own while the ranks compute. Rank 0 then gathers the output and compares it
with the single-GPU call. With ``omnicupy.attention_backward`` in the installation the gradients
are checked the same way. Without a GPU (or without a launcher) it says so and does what it can.

In a real model each rank already holds only its shard (the layers before attention work per
token); here every rank draws the whole input from one seed so that rank 0 can check the result.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast

import omnicupy  # noqa: E402
from omnicupy import BlockMask, arrays, masks  # noqa: E402


def build_mask(name: str, n: int):
    """The masks of issue 18 at length n."""
    if name == "causal":
        mod = masks.causal()
    elif name == "sliding_window":
        mod = masks.sliding_window(4096)
    elif name == "document":  # packed documents of 256-2048 tokens, causal inside each
        lengths = np.random.default_rng(0).integers(256, 2049, size=n // 256 + 1)
        mod = masks.document(masks.doc_ids_from_lengths(lengths)[:n])
    elif name == "global_window":  # 64 global tokens (seen by and seeing everything) + a causal window of 2048
        mod = masks.or_masks(masks.sliding_window(2048), masks.MaskMod(lambda b, h, q, kv: (q < 64) | (kv < 64),
                                                                        "global_64"))
    else:  # a VLM sequence: text causal, each 576-token image sees itself whole
        sizes = [512, 576] * (n // 1088 + 1)
        mod = masks.interleaved([("text" if i % 2 == 0 else "image", s) for i, s in enumerate(sizes)])
    return BlockMask.from_mask_mod(mod, None, None, n, n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mask", choices=["interleaved", "causal", "document", "sliding_window", "global_window"],
                        default="interleaved")
    parser.add_argument("--n", type=int, default=32768, help="sequence length (default 32768)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer k/v heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    args = parser.parse_args()
    if not arrays.gpu_available():
        # The plan needs no GPU: show who would own which tokens and who would send what to whom.
        print("context_parallel.py needs one NVIDIA GPU per process to run; none is usable here. The plan:")
        bm = build_mask(args.mask, args.n)
        print(f"mask {args.mask}, {bm!r}")
        for world in (2, 4):
            print(omnicupy.distributed.plan(bm, world))
        return 0
    import cupy as cp

    from omnicupy import distributed as dist

    comm = dist.init()  # torchrun's or mpirun's environment; one rank when started by neither
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    bm = build_mask(args.mask, args.n)
    kv_heads = args.kv_heads or args.heads
    plan = dist.plan(bm, comm.size, heads=(args.heads, kv_heads))  # keys or queries travel, per pair
    say(f"{comm.size} rank(s); mask {args.mask}, N={args.n}\n{plan.summary()}")

    dtype = {"fp16": np.float16, "bf16": arrays.BFLOAT16}[args.dtype]
    rng = np.random.default_rng(1234)
    shape_q, shape_kv = (1, args.heads, args.n, args.head_dim), (1, kv_heads, args.n, args.head_dim)
    q = cp.asarray(rng.standard_normal(shape_q).astype(dtype))
    k, v = (cp.asarray(rng.standard_normal(shape_kv).astype(dtype)) for _ in range(2))
    q_r, k_r, v_r = (dist.shard(x, plan, comm.rank) for x in (q, k, v))

    out_r, lse_r = dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True)  # first call: compiles
    comm.barrier()
    start = time.perf_counter()
    for _ in range(5):
        out_r, lse_r = dist.attention(q_r, k_r, v_r, plan, comm, return_lse=True)
    cp.cuda.get_current_stream().synchronize()
    comm.barrier()
    ms = (time.perf_counter() - start) / 5 * 1e3
    sent = plan.bytes_sent(comm.rank, batch=1, kv_heads=kv_heads, head_dim=args.head_dim, itemsize=2,
                           q_heads=args.heads)
    print(f"rank {comm.rank}: {q_r.shape[2]} tokens, forward {ms:.2f} ms, sent {sent / 2**20:.1f} MiB "
          "(K/V, queries and answers)")

    out = dist.unshard(out_r, plan, comm)  # every rank gets the whole output
    tol = {"fp16": 3e-3, "bf16": 2e-2}[args.dtype]

    def relative(a, b) -> float:
        a, b = a.astype(cp.float32), b.astype(cp.float32)
        return float(cp.linalg.norm(a - b) / cp.linalg.norm(b))

    if comm.rank == 0:
        want, want_lse = omnicupy.attention(q, k, v, bm, return_lse=True)
        err = relative(out, want)
        print(f"forward: relative error against one GPU {err:.2e} ({'ok' if err <= tol else 'FAILED'}, "
              f"tolerance {tol})")

    if getattr(omnicupy, "attention_backward", None) is None:
        say("omnicupy.attention_backward is not in this installation: the backward is skipped")
    else:
        dout = cp.asarray(rng.standard_normal(shape_q).astype(dtype))
        grads_r = dist.attention_backward(dist.shard(dout, plan, comm.rank), q_r, k_r, v_r, out_r, lse_r, plan, comm)
        grads = [dist.unshard(g, plan, comm) for g in grads_r]
        if comm.rank == 0:
            wants = omnicupy.attention_backward(dout, q, k, v, want, want_lse, bm)
            for name, g, w in zip(("dq", "dk", "dv"), grads, wants):
                err = relative(g, w)
                print(f"{name}: relative error against one GPU {err:.2e} ({'ok' if err <= tol else 'FAILED'})")
    comm.barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
