"""Argument checks of the distributed entry points (plan, shard, unshard, gather_shards, attention,
attention_backward), run before any NCCL or GPU call: each raises a named omnicupy error
(ArgumentError) naming the argument. Knows the entry points' contracts, nothing of transfers."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from .. import arrays
from ..checks import check_int
from ..errors import ArgumentError
from ..mask import BlockMask


def _is_array(x: Any) -> bool:
    return arrays.is_numpy(x) or arrays.is_cupy(x) or hasattr(x, "__dlpack__") \
        or hasattr(x, "__cuda_array_interface__")


def check_plan_args(block_mask: Any, weights: Any) -> None:
    """plan(): a BlockMask whose q and kv lengths agree, and weights as a mapping (or None)."""
    if not isinstance(block_mask, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(block_mask).__name__}")
    if weights is not None and not isinstance(weights, Mapping):
        raise ArgumentError(f"weights must be a mapping of block type -> cost (e.g. {{'FULL': 2.0}}), "
                            f"got {type(weights).__name__}")


def check_plan(plan: Any) -> None:
    from .planner import ShardPlan  # the planner imports this module's siblings only

    if not isinstance(plan, ShardPlan):
        raise ArgumentError(f"plan must be an omnicupy.distributed.ShardPlan (from distributed.plan), "
                            f"got {type(plan).__name__}")


def check_comm(comm: Any) -> None:
    from .comm import Communicator

    if not isinstance(comm, Communicator):
        raise ArgumentError(f"comm must be an omnicupy.distributed.Communicator (from distributed.init), "
                            f"got {type(comm).__name__}")


def check_shard_args(x: Any, plan: Any, *, rank: Optional[Any] = None, comm: Any = None, axis: Any = 2,
                     needs_comm: bool = False) -> None:
    """shard()/unshard(): an array, a plan, an int axis, a rank in [0, world_size) and, for unshard, a
    communicator of the plan's world size."""
    if not _is_array(x):
        raise ArgumentError(f"x must be a NumPy/CuPy array or a DLPack / CUDA-array-interface object, "
                            f"got {type(x).__name__}")
    check_plan(plan)
    check_int(axis, "axis", minimum=-64)
    if rank is not None:
        check_int(rank, "rank", minimum=0, maximum=plan.world_size - 1)
    if needs_comm:
        check_comm(comm)
        if comm.size != plan.world_size:
            raise ArgumentError(f"comm has {comm.size} ranks but the plan was made for {plan.world_size}")


def check_shards(shards: Any, plan: Any, axis: Any) -> None:
    """gather_shards(): a sequence of arrays and a plan."""
    check_plan(plan)
    check_int(axis, "axis", minimum=-64)
    if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__") or not all(_is_array(s) for s in shards):
        raise ArgumentError("shards must be a sequence of arrays, one per rank")


def check_call(plan: Any, comm: Any, **flags: Any) -> None:
    """attention()/attention_backward(): plan, communicator and boolean flags."""
    check_plan(plan)
    check_comm(comm)
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ArgumentError(f"{name} must be True or False, got {value!r}")


__all__ = ["check_plan_args", "check_plan", "check_comm", "check_shard_args", "check_shards", "check_call"]
