"""``omnicupy plan``: which kernel a call with these shapes would run, on which architecture, and why.

Needs no GPU: the arrays are stand-ins of the given shapes (``numpy.broadcast_to`` of one row, no
memory), the mask is built on the host, and ``omnicupy.plan`` (or the backward's plan) answers
for ``--arch``. Prints the plan's description (kernel, family, tile, grid, shared memory, reason).
"""
from __future__ import annotations

import argparse

import numpy as np

from .. import arrays
from .common import NO_GPU_ARCHS, UsageError, positive_int

MASKS = ("full", "causal", "sliding_window:W", "prefix_lm:P", "local_window:L,R")


def _mask(spec: str, q_len: int, kv_len: int):
    """(block_mask or None, causal) for ``--mask``."""
    from .. import BlockMask, masks

    name, _, arg = spec.partition(":")
    if name == "full" and not arg:
        return None, False
    if name == "causal" and not arg:
        return None, True
    try:
        numbers = [int(x) for x in arg.split(",")] if arg else []
    except ValueError:
        raise UsageError(f"--mask {spec!r}: the argument must be whole numbers") from None
    makers = {"sliding_window": (masks.sliding_window, 1), "prefix_lm": (masks.prefix_lm, 1),
              "local_window": (masks.local_window, 2)}
    if name not in makers or len(numbers) != makers[name][1]:
        raise UsageError(f"--mask must be one of {', '.join(MASKS)}, got {spec!r}")
    return BlockMask.from_mask_mod(makers[name][0](*numbers), None, None, q_len, kv_len), False


def run(args: argparse.Namespace) -> int:
    from .. import plan as forward_plan
    from ..ops.backward import plan as backward_plan

    kv_len = args.kv_len or args.q_len
    kv_heads = args.kv_heads or args.heads
    dtype = np.dtype(np.float16) if args.dtype == "fp16" else arrays.BFLOAT16
    if dtype is None:
        raise UsageError("--dtype bf16 needs the ml_dtypes package")
    one = np.zeros(args.head_dim, dtype)  # one row: the last dim stays contiguous, nothing else is stored
    q = np.broadcast_to(one, (args.batch, args.heads, args.q_len, args.head_dim))
    k = np.broadcast_to(one, (args.batch, kv_heads, kv_len, args.head_dim))
    block_mask, causal = _mask(args.mask, args.q_len, kv_len)
    arch = args.arch
    if arch is None:
        from .. import jit

        arch = jit.device_arch() if arrays.gpu_available() else NO_GPU_ARCHS[0]
    which = backward_plan if args.backward else forward_plan
    result = which(q, k, k, block_mask, causal=causal, arch=arch)
    print(f"B={args.batch} Hq={args.heads} Hkv={kv_heads} Nq={args.q_len} Nkv={kv_len} D={args.head_dim} "
          f"{args.dtype}, mask {args.mask}, arch {arch}")
    print(result)
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    from .common import cache_dir_option

    p = commands.add_parser(
        "plan", parents=[cache_dir_option()], help="print the kernel a call would run (no GPU needed)",
        description="Print the plan omnicupy.attention (or, with --backward, attention_backward) would follow "
                    "for these shapes on --arch: the kernel variant, its family and tile, the grid, the shared "
                    "memory and the reason. Needs no GPU and compiles nothing.")
    p.add_argument("--q-len", type=positive_int, default=8192, metavar="N", help="query length (default 8192)")
    p.add_argument("--kv-len", type=positive_int, default=None, metavar="N", help="key length (default: --q-len)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="B")
    p.add_argument("--heads", type=positive_int, default=16, metavar="H", help="query heads (default 16)")
    p.add_argument("--kv-heads", type=positive_int, default=None, metavar="H", help="key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=128, metavar="D")
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--mask", default="causal", metavar="MASK", help=f"one of {', '.join(MASKS)} (default causal)")
    p.add_argument("--arch", default=None, help=f"e.g. sm_80, sm_90 (default: this GPU's, else {NO_GPU_ARCHS[0]})")
    p.add_argument("--backward", action="store_true", help="the backward's plan instead of the forward's")
    p.set_defaults(func=run)
