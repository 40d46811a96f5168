"""The split-KV decode's plan: how a kv head's query rows pack into m tiles, how many CTAs split
each sequence's keys, and the launches of the split kernel and the merge.

``plan_split_kv`` turns a decode call's shapes (and the target arch's shared memory and SM count)
into a DecodePlan: the split kernel's Plan, the combine's (None with one split or a fused merge),
the row packing and the split count, with the reason. Its tunables (FUSED_COMBINE, MAX_SPLITS, ...,
and the slots' DECODE_TILES and COMBINE_WARPS) are read per call (``settings()``); tuning tools
rebind them through ``omnicupy.ops.decode``. Knows the decode slots and the arch table; nothing of
arrays (the call's arguments are judged in ops/decode.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

from ..checks import check_int
from ..errors import ArgumentError
from ..mask.types import cdiv
from . import arch as arch_table
from .plan import Plan
from .specs import decode_combine, decode_split
from .specs.base import Launch
from .specs.decode_split import DECODE_BC
from .variant import SUPPORTED_HEAD_DIMS, Variant

#: Packed query rows (GQA group x positions) per kv head up to which attention() takes the decode
#: kernel on its own; above, the forward kernel's q tiles are full enough.
DECODE_MAX_ROWS = 64
MAX_SPLITS = 128
#: Each kv group of a split walks at least this many 32-key tiles (or the split count shrinks).
MIN_TILES_PER_GROUP = 2
#: The smallest split count whose wave efficiency is within this factor of the best is chosen.
WAVE_TOLERANCE = 0.95
#: Merge the splits in the split kernel's last CTA per (m tile, kv head, batch) (an atomic counter
#: per unit) instead of a second, combine launch; plan_split_kv(fused_combine=...) overrides it per
#: plan. On: benchmarks/tune_decode.py on the H200 (fp16, D = 128, Hq 32 / Hkv 8, Nq 1) measured
#: +11 % / +4 % / +3 % at B = 1 x 8k / 32k / 128k and within 1 % of the two-launch merge elsewhere.
FUSED_COMBINE = True


# ------------------------------------------------------------------------------------------ plan
def _smem(arch: Optional[str]) -> int:
    """Opt-in shared memory per block of the target (sm_90's without one: the decode tiles' fit)."""
    return arch_table.caps(arch or "sm_90").smem_optin


def decode_variant(head_dim: int, dtype: str, br: int, *, causal: bool, partial: bool,
                   score_expr: Optional[tuple], arch: Optional[str]) -> Variant:
    """The split kernel for this tile, its ring trimmed to ``arch``'s shared memory (specs/decode_split.py)."""
    return decode_split.decode_variant(head_dim, dtype, br, causal=causal, partial=partial, score_expr=score_expr,
                                       smem_limit=_smem(arch))


def combine_variant(head_dim: int, dtype: str) -> Variant:
    return decode_combine.combine_variant(head_dim, dtype)


@dataclass(frozen=True)
class Rows:
    """How the query rows of one kv head are packed into m tiles: row r of a tile is query head
    ``head_block * heads_per_tile + r // q_per_tile`` of the group at position
    ``q_block * q_per_tile + r % q_per_tile``."""

    br: int
    heads_per_tile: int
    q_per_tile: int
    head_blocks: int
    m_tiles: int


def pack_rows(group: int, q_len: int, shared_mask: bool = True) -> Rows:
    """The m tiles of one kv head: its ``group`` query heads (one at a time when the mask differs
    per head) times ``q_len`` positions, at most 64 rows a tile."""
    heads = group if shared_mask else 1
    rows = heads * q_len
    if rows <= 64:
        br = next(b for b in (16, 32, 64) if rows <= b)
        per_tile_heads, per_tile_q = heads, q_len
    elif heads <= 64:
        br, per_tile_heads, per_tile_q = 64, heads, 64 // heads
    else:
        br, per_tile_heads, per_tile_q = 64, 64, 1
    head_blocks = cdiv(group, per_tile_heads)
    return Rows(br, per_tile_heads, per_tile_q, head_blocks, head_blocks * cdiv(q_len, per_tile_q))


@dataclass(frozen=True)
class Rule:
    """Rule mode: which keys a row sees (module docstring); ``q_abs``: score modifiers see the
    query's position ``pos`` as q_idx (paged caches) instead of its row index i (attention())."""

    causal: bool = False
    window: int = 0
    bottom_right: bool = False
    q_abs: bool = False


@dataclass(frozen=True)
class DecodePlan:
    """The split kernel's launch, the combine's (None with one split), and how rows and keys are cut."""

    split: Plan
    combine: Optional[Plan]
    rows: Rows
    num_splits: int
    rule: Optional[Rule]  # None in mask mode
    reason: str
    #: the split kernel merges the splits itself (last CTA per unit; combine is None then)
    fused: bool = False

    @property
    def kernels(self) -> tuple[str, ...]:
        return (self.split.kernel,) + ((self.combine.kernel,) if self.combine else ())

    # One shape with every operation's Plan: the main launch's attributes (the split kernel's),
    # and every launch in order.
    @property
    def launches(self) -> tuple[Launch, ...]:
        return self.split.launches + (self.combine.launches if self.combine else ())

    @property
    def variant(self) -> Variant:
        return self.split.variant

    @property
    def kernel(self) -> str:
        return self.split.kernel

    @property
    def operation(self) -> str:
        return "decode"

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.split.grid

    @property
    def block(self) -> tuple[int, int, int]:
        return self.split.block

    @property
    def smem_bytes(self) -> int:
        return self.split.smem_bytes

    @property
    def q_tile_order(self) -> None:
        return None

    @property
    def arch(self) -> Optional[str]:
        return self.split.arch

    def describe(self) -> str:
        r = self.rows
        mode = "block mask" if self.rule is None else (
            f"rule (causal={self.rule.causal}, window={self.rule.window or None}, bottom_right={self.rule.bottom_right})")
        merge = (f" + {self.combine.kernel}" if self.combine else
                 " (merged by the last CTA of each unit)" if self.fused else "")
        text = (f"decode: {self.split.kernel} x {self.num_splits} splits{merge}\n"
                f"  m tile {r.br} rows = {r.heads_per_tile} query heads x {r.q_per_tile} positions, "
                f"{r.m_tiles} m tiles per kv head; {mode}\n"
                f"  grid {self.split.grid}, block {self.split.block}, {self.split.smem_bytes} bytes of shared memory\n"
                f"  why: {self.reason}")
        return text

    def __str__(self) -> str:
        return self.describe()


def _sms(num_sms: Optional[int]) -> int:
    if num_sms is not None:
        return check_int(num_sms, "num_sms", minimum=1)
    return arch_table.sm_count()  # the current device's, else the table's default (an H100/H200)


#: Sequences of different lengths, when their CTAs already fill the machine: split until there are
#: this many waves of CTAs (so that the long sequences' CTAs do not run alone at the end), keeping
#: at least RAGGED_MIN_KEYS keys per split (each CTA has a fixed cost: Q, ring fill, merge).
RAGGED_WAVES = 4
RAGGED_MIN_KEYS = 8192


def choose_splits(units: int, tiles: int, kv_groups: int, ctas_per_sm: int, num_sms: int, ragged: bool = False) -> int:
    """How many CTAs share one (m tile, kv head, batch)'s keys.

    ``units`` CTAs exist without splitting, each walking up to ``tiles`` 32-key tiles. Splits fill
    the machine: among the split counts that leave every kv group at least MIN_TILES_PER_GROUP
    tiles, the smallest whose wave efficiency (CTAs over the slots of the waves they take) is
    within WAVE_TOLERANCE of the best. Fewer splits mean less partial traffic and a cheaper
    combine. With ``ragged`` lengths (or lengths known only on the device) the work per CTA
    differs: when the CTAs fill at least one wave anyway, the split count also reaches
    RAGGED_WAVES waves, for balance (measured on the H200, B 32, lengths 1k-128k: 3.22 -> 3.83
    TB/s; splitting below one wave or below RAGGED_MIN_KEYS keys per split cost up to 40 %)."""
    slots = num_sms * max(1, ctas_per_sm)
    most = max(1, min(MAX_SPLITS, tiles // (MIN_TILES_PER_GROUP * kv_groups)))

    def efficiency(s: int) -> float:
        ctas = units * s
        return ctas / (cdiv(ctas, slots) * slots)

    best = max(efficiency(s) for s in range(1, most + 1))
    splits = next(s for s in range(1, most + 1) if efficiency(s) >= WAVE_TOLERANCE * best)
    if ragged and units * splits >= slots:
        balance = min(most, tiles // (RAGGED_MIN_KEYS // DECODE_BC), cdiv(RAGGED_WAVES * slots, units))
        splits = max(splits, balance)
    return splits


def _ctas_per_sm(variant: Variant, arch: Optional[str]) -> int:
    per_sm = _smem(arch) + 1024  # the opt-in limit per block, plus the reserved 1 KB
    by_smem = per_sm // (variant.smem_bytes + 1024)
    return max(1, min(by_smem, 2048 // variant.threads))


def plan_split_kv(*, head_dim: int, dtype: str, batch: int, heads: int, kv_heads: int, q_len: int,
                  longest: int, rows: Rows, rule: Optional[Rule], mask_features: tuple[bool, bool] = (False, False),
                  score_expr: Optional[tuple] = None, num_splits: Optional[int] = None, ragged: bool = False,
                  arch: Optional[str] = None, num_sms: Optional[int] = None, why: str = "",
                  fused_combine: Optional[bool] = None) -> DecodePlan:
    """Plan both kernels. ``longest``: the most keys one tile's walk can cover (bounds the splits);
    ``ragged``: sequence lengths differ or are not known on the host (choose_splits); ``rule`` None
    means mask mode with ``mask_features`` (causal, partial); ``fused_combine`` (default
    FUSED_COMBINE) merges the splits in the split kernel. Plans are cached: a decode loop plans
    once per power of two of its longest sequence."""
    longest = 1 << max(longest - 1, 0).bit_length()
    fused = FUSED_COMBINE if fused_combine is None else bool(fused_combine)
    return _plan_split_kv(head_dim, dtype, batch, heads, kv_heads, q_len, longest, rows, rule, mask_features,
                          score_expr, num_splits, ragged, arch, _sms(num_sms), why, fused, settings())


def settings() -> tuple:
    """What a plan depends on beside the call, read now: this module's tunables. Tuning tools and
    tests change them between calls, so the plan cache and the steady-state keys (ops/forward.py,
    ops/paged.py) include them: a changed tunable plans anew instead of replaying an old launch.
    DECODE_MAX_ROWS decides whether attention() takes the decode kernel at all."""
    return (FUSED_COMBINE, DECODE_MAX_ROWS, MAX_SPLITS, MIN_TILES_PER_GROUP, WAVE_TOLERANCE, RAGGED_WAVES,
            RAGGED_MIN_KEYS, decode_combine.COMBINE_WARPS, decode_split.DECODE_TILES)


@functools.lru_cache(maxsize=256)
def _plan_split_kv(head_dim, dtype, batch, heads, kv_heads, q_len, longest, rows, rule, mask_features, score_expr,
                   num_splits, ragged, arch, sms, why, fused=False, tunables=()) -> DecodePlan:
    # ``tunables`` (settings()) is only part of the cache key: the body reads the module's values.
    if rule is not None:
        causal, partial = rule.causal or rule.window > 0, False
    else:
        causal, partial = mask_features
    split_v = decode_variant(head_dim, dtype, rows.br, causal=causal, partial=partial, score_expr=score_expr,
                             arch=arch)
    # the launches, main first (one shape with every operation's Plan)
    units = batch * kv_heads * rows.m_tiles
    if num_splits is None:
        splits = choose_splits(units, cdiv(max(longest, 1), DECODE_BC), split_v.kv_groups,
                               _ctas_per_sm(split_v, arch), sms, ragged)
        how = (f"{splits} splits from the heuristic ({units} CTAs unsplit, {sms} SMs, up to {longest} keys"
               + (", ragged lengths" if ragged else "") + ")")
    else:
        splits = num_splits
        how = f"{splits} splits as asked"
    grid = units * splits
    if grid >= 2**31:
        raise ArgumentError(f"decode: {grid} CTAs exceed the grid limit; use fewer splits")
    split_plan = Plan(variant=split_v, grid=(grid, 1, 1), block=(split_v.threads, 1, 1),
                      smem_bytes=split_v.smem_bytes, q_tile_order=None, arch=arch,
                      reason=f"split-KV decode: {why}; {how}")
    combine_plan = None
    fused = fused and splits > 1
    if splits > 1 and not fused:
        cv = combine_variant(head_dim, dtype)
        out_rows = batch * heads * q_len
        combine_plan = Plan(variant=cv, grid=(cdiv(out_rows, decode_combine.COMBINE_WARPS), 1, 1), block=(cv.threads, 1, 1),
                            smem_bytes=0, q_tile_order=None, arch=arch,
                            reason=f"merge {splits} partial rows per output row")
    return DecodePlan(split_plan, combine_plan, rows, splits, rule, split_plan.reason, fused)


def shipped_variants(arch: Optional[str] = None, head_dims=SUPPORTED_HEAD_DIMS, dtypes=("fp16", "bf16")) -> list[Variant]:
    """Every decode tile with every mask-feature combination, and the combines: what a precompile
    builds (score-modifier variants are built on first use)."""
    out = []
    for hd in head_dims:
        for dt in dtypes:
            for br in (16, 32, 64):
                for causal in (False, True):
                    for partial in (False, True):
                        out.append(decode_variant(hd, dt, br, causal=causal, partial=partial, score_expr=None,
                                                  arch=arch))
            out.append(combine_variant(hd, dt))
    return out


def rule_span(rule: Rule, q_len: int, longest: int) -> int:
    """The most keys one m tile's walk covers under ``rule``."""
    if rule.window > 0:
        return min(longest, rule.window + q_len)
    return longest


#: The module holding each tunable a tuning tool may rebind (through omnicupy.ops.decode).
TUNABLES = {"FUSED_COMBINE": "decode_plan", "DECODE_MAX_ROWS": "decode_plan", "MAX_SPLITS": "decode_plan",
            "MIN_TILES_PER_GROUP": "decode_plan", "WAVE_TOLERANCE": "decode_plan", "RAGGED_WAVES": "decode_plan",
            "RAGGED_MIN_KEYS": "decode_plan", "COMBINE_WARPS": "decode_combine", "DECODE_TILES": "decode_split"}


def tunable_home(name: str) -> Any:
    """The module that holds tunable ``name`` (TUNABLES)."""
    import sys

    return {"decode_plan": sys.modules[__name__], "decode_combine": decode_combine,
            "decode_split": decode_split}[TUNABLES[name]]
