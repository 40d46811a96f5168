"""A/B of the tma forward's persistent CTAs: one compiled kernel launched three ways on the same inputs.

    PYTHONPATH=. python lab/bench/ab_persistent_tma.py [--cases 128:causal:8192:2,...] [--rounds 9] [--reps 10]
                                                       [--seed 1234] [--json out.json] [--no-torch] [--no-wgmma]
    PYTHONPATH=. python lab/bench/ab_persistent_tma.py --dry-run    # no GPU: the planned grid and tile lists

Needs an sm_90 GPU (H100, H200) and CuPy; torch is optional (the cuDNN column). ``--dry-run`` needs
no GPU: it only plans.

On sm_90 the tma forward family runs persistent CTAs: grid = min(tiles, SM count), each CTA
looping over q tiles. Its Plan carries ``cta_tiles``: per-CTA tile lists balanced on the host
(longest processing time first, dispatch/schedule.py), or None when grid stride is as good (every
tile costs the same). For each case (head dim D, mask, N, batch B; H = 16, fp16) the script calls
``omnicupy.attention`` with OMNICUPY_MMA=tma, takes the recipe that call left on the mask and
launches the same compiled kernel three ways:

  persistent     the recipe as planned: the plan's grid, its tile lists when it has them
  one per tile   grid = every tile, no lists: one CTA per tile, the hardware hands out the work
  grid stride    the plan's grid, no lists: CTA c runs the flat tiles c, c + grid, c + 2 grid, ...

Checked before anything is timed: the three outputs must be bitwise identical (every tile is
computed by one CTA running the same code), and sampled rows of (batch 0, head 0) must match a
float64 NumPy reference built from the element-level mask (``bm.to_dense()``) within fp16's
tolerance (relative error 3e-3, benchmarks/_systems.TOLERANCE). A case that fails is marked
WRONG, is not timed, has no ratios, and makes the exit status 1. The wgmma family
(OMNICUPY_MMA=wgmma, its recipe launched directly) and SDPA's cuDNN backend (full and causal only)
are checked against the same reference; a wrong one is not timed.

Timing: GPU ms per call, CUDA events around single calls (benchmarks/_systems.time_ms), launches
interleaved round robin over --rounds rounds of --reps calls, so that clock and L2 drift hit every
launch alike; the median over rounds of each round's median. CuPy launches are timed with CuPy
events on CuPy's current stream, cuDNN with torch events on torch's current stream, the device
synchronized (both libraries) before every series.

Masks: ``full``, ``causal``, ``document`` (packed documents, causal inside each; lengths uniform in
[256, 2048], drawn from --seed). The table comes last: kernel, mask, N, B, grid, tiles, lists
(LPT tile lists used), max|diff| (largest |difference| of one-per-tile and grid-stride against
persistent), err64 (largest |error| of the sampled rows against float64), ms per launch,
one/pers and cuDNN/pers (> 1: persistent is faster). ``--json PATH`` writes the rows too, with the
relative errors, the grid-stride ratio and notes (after every case, so a run cut short keeps what
it measured). A case that raises is reported, counts as wrong, and the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import omnicupy  # noqa: E402
from benchmarks import _cases, _report, _systems  # noqa: E402
from benchmarks.bench_tma import family  # noqa: E402
from omnicupy import BlockMask, masks  # noqa: E402
from omnicupy.dispatch import plan as planning  # noqa: E402
from omnicupy.mask import cdiv  # noqa: E402
from omnicupy.ops import recall  # noqa: E402

HEADS = 16
DTYPE = "fp16"
MASKS = ("full", "causal", "document")
#: The cases of the first persistent-CTA measurements (lab/results/persistent_tma_h200.txt).
DEFAULT_CASES = ("128:full:8192:2,128:causal:8192:2,64:full:8192:2,64:causal:8192:2,"
                 "128:full:1024:8,128:causal:1024:8,128:full:2048:4,128:causal:2048:4,128:document:8192:2")
DEFAULT_SEED = 1234
#: Document lengths of the packed-document mask (the benchmark suite's range, benchmarks/_cases.py).
DOC_MIN, DOC_MAX = _cases.DOC_MIN, _cases.DOC_MAX
#: Rows of (batch 0, head 0) checked against float64: the first, the last and random others.
CHECK_ROWS = 8
#: Untimed calls before each timed series: they absorb the switch from the previous launch.
WARMUP_CALLS = 2
CASE_FORMAT = "HEAD_DIM:MASK:N:B"


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    head_dim: int
    mask: str
    seq_len: int
    batch: int

    @property
    def label(self) -> str:
        return f"D={self.head_dim} {self.mask} N={self.seq_len} B={self.batch}"


def parse_case(text: str) -> Case:
    """``"128:causal:8192:2"`` -> Case(128, "causal", 8192, 2); argparse shows the error's message."""
    parts = text.strip().split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"case {text!r}: expected {CASE_FORMAT}, e.g. 128:causal:8192:2")
    head_dim, mask, seq_len, batch = parts
    if mask not in MASKS:
        raise argparse.ArgumentTypeError(f"case {text!r}: unknown mask {mask!r} (known: {', '.join(MASKS)})")
    numbers = []
    for name, value in (("HEAD_DIM", head_dim), ("N", seq_len), ("B", batch)):
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number <= 0:
            raise argparse.ArgumentTypeError(f"case {text!r}: {name} must be a positive integer, got {value!r}")
        numbers.append(number)
    return Case(numbers[0], mask, numbers[1], numbers[2])


def parse_cases(text: str) -> list[Case]:
    """Comma-separated cases (see parse_case); at least one."""
    cases = [parse_case(item) for item in text.split(",") if item.strip()]
    if not cases:
        raise argparse.ArgumentTypeError(f"no cases in {text!r}: expected {CASE_FORMAT},...")
    return cases


def document_lengths(seq_len: int, seed: int) -> np.ndarray:
    """Document lengths that cover ``seq_len`` tokens (the last one cut by the caller)."""
    rng = np.random.default_rng([seed, seq_len])
    # Enough documents even if every one is as short as allowed.
    return rng.integers(DOC_MIN, DOC_MAX + 1, size=seq_len // DOC_MIN + 1)


def build_mask(case: Case, seed: int, xp: Any = None) -> BlockMask:
    """The case's BlockMask, broadcast over batch and heads. ``xp``: the array module the document
    mask is evaluated with (None: omnicupy's default, CuPy with a GPU). Full and causal are built
    from their mask_mods, not as the built-in rule masks: a rule mask may be planned on a rule tile
    (tiles.TMA_RULE_TILES, re-blocked to 192-row q blocks), and this A/B is about the tuned tile's
    persistent launch."""
    n = case.seq_len
    if case.mask == "full":  # a prefix as long as the sequence: every pair
        return BlockMask.from_mask_mod(masks.prefix_lm(n), None, None, n, n, xp=xp)
    if case.mask == "causal":
        return BlockMask.from_mask_mod(masks.causal(), None, None, n, n, xp=xp)
    ids = masks.doc_ids_from_lengths(document_lengths(n, seed))[:n]
    return BlockMask.from_mask_mod(masks.document(ids), None, None, n, n, xp=xp)


def flat_tiles(plan: planning.Plan, case: Case) -> int:
    """Every (batch, head, q tile) of the launch: what one-CTA-per-tile launches as its grid."""
    return cdiv(case.seq_len, plan.variant.br) * HEADS * case.batch


# --------------------------------------------------------------------------------------- tables
def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """A Markdown table (readable in a terminal, pasteable into a results file); the first ``left``
    columns are text, the others right-aligned."""
    widths = [max(3, *(len(str(r[i])) for r in (header, *rows))) for i in range(len(header))]  # "--:" at least

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) if i < left else str(c).rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join("-" * w if i < left else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


# -------------------------------------------------------------------------------------- dry run
def plan_case(case: Case, seed: int) -> dict:
    """What the tma family would launch for ``case`` on sm_90, planned on the CPU."""
    bm = build_mask(case, seed, xp=np)  # NumPy: no device wanted, even where there is one
    plan = planning.plan_forward(head_dim=case.head_dim, dtype=DTYPE, batch=case.batch, heads=HEADS, block_mask=bm,
                                 stages=None, bias=None, mask_expr=None, score_expr=None, arch="sm_90", family="tma")
    return {"case": case, "kernel": plan.kernel, "family": plan.variant.family, "grid": plan.grid[0],
            "tiles": flat_tiles(plan, case), "lists": plan.cta_tiles is not None}


def dry_run(cases: Sequence[Case], seed: int) -> int:
    print(f"dry run: tma plans for sm_90, {DTYPE}, H={HEADS}; grid = min(tiles, SM count) for persistent CTAs "
          "(this device's SMs, 132 without a GPU); lists: LPT per-CTA tile lists (n: grid stride)")
    rows = []
    for case in cases:
        p = plan_case(case, seed)
        rows.append([p["kernel"], case.mask, str(case.head_dim), str(case.seq_len), str(case.batch), str(p["grid"]),
                     str(p["tiles"]), "y" if p["lists"] else "n"])
    print(format_table(["kernel", "mask", "D", "N", "B", "grid", "tiles", "lists"], rows))
    return 0


# ---------------------------------------------------------------------------------- launches
def stored_recipe(bm: BlockMask, call: Callable[[], Any]) -> Any:
    """Run ``call`` (an omnicupy.attention call with ``bm``) and return the recipe it left on the mask:
    the launch of the compiled kernel with everything but the data pointers decided (ops/recall.py)."""
    recipes = recall.store_of(bm)
    before = set(recipes)
    call()
    new = [recipe for key, recipe in recipes.items() if key not in before]
    if len(new) != 1:
        raise RuntimeError(f"expected the call to store one recipe on the mask, found {len(new)}")
    return new[0]


def without_tile_lists(recipe: Any, grid: tuple[int, int, int]) -> Any:
    """The recipe's kernel and parameter struct on ``grid`` with null tile lists: the kernel then walks
    the flat tiles by grid stride (tile = blockIdx.x, then += gridDim.x; templates/attention_fwd_tma)."""
    from omnicupy.jit.launch import KernelLaunch, Launcher

    template = bytearray(recipe.launcher.template)
    for name in ("cta_tiles", "tile_list"):
        at = recipe.params.offset(name)
        template[at:at + 8] = bytes(8)  # a null pointer field
    plan = dataclasses.replace(recipe.plan, grid=grid, cta_tiles=None)
    launch = KernelLaunch(recipe.kernel, plan.grid, plan.block, plan.smem_bytes)
    return dataclasses.replace(recipe, plan=plan, launcher=Launcher(bytes(template), [launch]))


def pointers_call(recipe: Any, q: Any, k: Any, v: Any, out: Any) -> Callable[[], None]:
    """One launch of ``recipe`` writing ``out``; no log-sum-exp (a null pointer, as attention() passed)."""
    pointers = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0)
    return lambda: recipe.launch(*pointers)


def poisoned_like(cp: Any, x: Any) -> Any:
    """An output buffer full of NaN: a tile a launch skips cannot pass the check on leftover values."""
    return cp.full(x.shape, cp.nan, dtype=x.dtype)


def max_abs_diff(cp: Any, a: Any, b: Any) -> float:
    return float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())


def bitwise_equal(cp: Any, a: Any, b: Any) -> bool:
    """Equal bits (NaN included, which a comparison of values would call different)."""
    return bool(cp.array_equal(a.view(cp.uint16), b.view(cp.uint16)))


# ------------------------------------------------------------------------------------ reference
def reference_rows(q: Any, k: Any, v: Any, bm: BlockMask, rows: np.ndarray) -> np.ndarray:
    """float64 softmax attention of ``rows`` of (batch 0, head 0) under the element-level mask."""
    n, d = q.shape[2], q.shape[3]
    qh, kh, vh = (np.asarray(x[0, 0].get(), dtype=np.float64) for x in (q, k, v))
    allowed = bm.to_dense()[0, 0, :n, :n][rows]  # the mask is broadcast: index 0 is batch 0 / head 0
    scores = np.where(allowed, qh[rows] @ kh.T / math.sqrt(d), -np.inf)
    top = scores.max(axis=1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=1, keepdims=True)
    # A row with no allowed key is 0 by omnicupy's contract (and 0/0 here otherwise).
    return np.where(total > 0, weights / np.where(total > 0, total, 1.0), 0.0) @ vh


def row_errors(out: Any, want: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """(largest |error|, relative Frobenius error) of ``out``'s rows of (batch 0, head 0); inf for NaN."""
    got = np.asarray(out[0, 0][rows].get(), dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf, math.inf
    diff = got - want
    return float(np.abs(diff).max()), float(np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30))


# --------------------------------------------------------------------------------------- timing
@dataclass
class Timed:
    """A launch to time, with the events of the library that issues it."""

    name: str
    call: Callable[[], Any]
    clock: _systems.Clock
    context: Callable[[], ContextManager] = contextlib.nullcontext


def time_round_robin(entries: Sequence[Timed], rounds: int, reps: int) -> dict[str, float]:
    """Median over rounds of each round's median ms per call; the launches take turns within a round."""
    samples: dict[str, list[float]] = {e.name: [] for e in entries}
    for _ in range(rounds):
        for e in entries:
            with e.context():
                # time_ms synchronizes the device after the warm-up calls: no work of the previous
                # launch (nor of the other library) runs inside this one's events.
                samples[e.name].append(_systems.time_ms(lambda i, call=e.call: call(), 1, e.clock, WARMUP_CALLS,
                                                        reps))
    return {name: statistics.median(values) for name, values in samples.items()}


# ------------------------------------------------------------------------------------- one case
def case_inputs(cp: Any, case: Case, seed: int) -> tuple[Any, Any, Any]:
    """q, k, v [B, H, N, D] fp16 from a generator seeded by ``seed`` and the case itself: a case gets the
    same inputs wherever it stands in --cases."""
    key = [seed, case.head_dim, MASKS.index(case.mask), case.seq_len, case.batch]
    case_seed = int(np.random.SeedSequence(key).generate_state(1)[0])
    rng = cp.random.default_rng(case_seed)
    shape = (case.batch, HEADS, case.seq_len, case.head_dim)
    return tuple(rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16) for _ in range(3))


def empty_row(case: Case) -> dict:
    return {"kernel": None, "head_dim": case.head_dim, "mask": case.mask, "seq_len": case.seq_len,
            "batch": case.batch, "heads": HEADS, "dtype": DTYPE, "grid": None, "tiles": None, "lists": None,
            "max_diff": None, "err64": None, "rel_err64": None, "correct": None,
            "ms_persistent": None, "ms_one_per_tile": None, "ms_grid_stride": None, "ms_wgmma": None,
            "ms_cudnn": None, "one_over_persistent": None, "stride_over_persistent": None,
            "cudnn_over_persistent": None, "wgmma_kernel": None, "err64_wgmma": None, "rel_err64_wgmma": None,
            "wgmma_correct": None, "err64_cudnn": None, "rel_err64_cudnn": None, "cudnn_correct": None, "notes": []}


def cudnn_call(gpu: Any, case: Case, q: Any, k: Any, v: Any) -> tuple[Callable[[], Any], Callable[[], ContextManager]]:
    """SDPA restricted to cuDNN on zero-copy torch views of q, k, v: (call, context to call it in)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (gpu.torch.from_dlpack(x) for x in (q, k, v))
    causal = case.mask == "causal"
    return (lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal),
            lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))


def run_case(gpu: Any, case: Case, args: argparse.Namespace) -> dict:
    """Check, then time, one case; the row of the table and of the JSON."""
    cp = gpu.cp
    tol = _systems.TOLERANCE[DTYPE]
    row = empty_row(case)
    q, k, v = case_inputs(cp, case, args.seed)
    bm = build_mask(case, args.seed)
    with family("tma", case.head_dim):
        persistent = stored_recipe(bm, lambda: omnicupy.attention(q, k, v, bm))
    plan = persistent.plan
    tiles = flat_tiles(plan, case)
    row.update(kernel=plan.kernel, grid=plan.grid[0], tiles=tiles, lists=plan.cta_tiles is not None)
    if plan.variant.family != "tma":
        row["notes"].append(f"OMNICUPY_MMA=tma planned the {plan.variant.family} family here: nothing to compare")
        return row
    launches = {"persistent": persistent, "one_per_tile": without_tile_lists(persistent, (tiles, 1, 1)),
                "grid_stride": without_tile_lists(persistent, plan.grid)}
    outs = {name: poisoned_like(cp, q) for name in launches}
    calls = {name: pointers_call(recipe, q, k, v, outs[name]) for name, recipe in launches.items()}
    for call in calls.values():
        call()
    gpu.sync()

    # Correctness first: a launch that skips or repeats tiles differs from the others or from float64.
    base = outs["persistent"]
    others = [outs["one_per_tile"], outs["grid_stride"]]
    row["max_diff"] = max(max_abs_diff(cp, base, o) for o in others)
    same_bits = all(bitwise_equal(cp, base, o) for o in others)
    rows = _cases.sample_rows(case.seq_len, CHECK_ROWS, args.seed)
    want = reference_rows(q, k, v, bm, rows)
    row["err64"], row["rel_err64"] = row_errors(base, want, rows)
    row["correct"] = same_bits and row["rel_err64"] <= tol
    if not same_bits:
        row["notes"].append("the three launches differ bitwise")
    if not row["rel_err64"] <= tol:
        row["notes"].append(f"relative error {row['rel_err64']:.1e} against float64 exceeds {tol:.0e}")
    if not row["correct"]:
        return row  # not timed: the time of a wrong launch means nothing

    timed = [Timed(name, call, _systems.Clock.for_cupy(gpu)) for name, call in calls.items()]
    if not args.no_wgmma:
        timed += wgmma_entry(gpu, case, bm, q, k, v, want, rows, row, tol)
    if gpu.torch is not None and case.mask in _cases.SDPA_MASKS:
        timed += cudnn_entry(gpu, case, q, k, v, want, rows, row, tol)
    times = time_round_robin(timed, args.rounds, args.reps)
    for name, ms in times.items():
        row[f"ms_{name}"] = ms
    pers = row["ms_persistent"]
    for name, key in (("one_per_tile", "one_over_persistent"), ("grid_stride", "stride_over_persistent"),
                      ("cudnn", "cudnn_over_persistent")):
        if row[f"ms_{name}"] is not None:
            row[key] = row[f"ms_{name}"] / pers
    return row


def wgmma_entry(gpu: Any, case: Case, bm: BlockMask, q: Any, k: Any, v: Any, want: np.ndarray, rows: np.ndarray,
                row: dict, tol: float) -> list[Timed]:
    """The wgmma family's recipe for the same call (checked; empty when wrong or not wgmma)."""
    with family("wgmma", case.head_dim):
        recipe = stored_recipe(bm, lambda: omnicupy.attention(q, k, v, bm))
    row["wgmma_kernel"] = recipe.plan.kernel
    if recipe.plan.variant.family != "wgmma":
        row["notes"].append(f"OMNICUPY_MMA=wgmma planned {recipe.plan.kernel}: wgmma not timed")
        return []
    out = poisoned_like(gpu.cp, q)
    call = pointers_call(recipe, q, k, v, out)
    call()
    gpu.sync()
    row["err64_wgmma"], row["rel_err64_wgmma"] = row_errors(out, want, rows)
    row["wgmma_correct"] = row["rel_err64_wgmma"] <= tol  # an omnicupy kernel: a wrong one fails the run too
    if not row["wgmma_correct"]:
        row["notes"].append(f"wgmma WRONG: relative error {row['rel_err64_wgmma']:.1e}; not timed")
        return []
    return [Timed("wgmma", call, _systems.Clock.for_cupy(gpu))]


def cudnn_entry(gpu: Any, case: Case, q: Any, k: Any, v: Any, want: np.ndarray, rows: np.ndarray, row: dict,
                tol: float) -> list[Timed]:
    """SDPA's cuDNN backend on the same inputs (checked; empty when unavailable or wrong)."""
    try:
        call, context = cudnn_call(gpu, case, q, k, v)
        gpu.sync()  # q, k, v were written on CuPy's stream
        with context():
            out = call()
        gpu.sync()
    except Exception as exc:  # noqa: BLE001 - a torch without cuDNN attention for this shape
        row["notes"].append(f"cuDNN unavailable: {type(exc).__name__}: {str(exc)[:160]}")
        return []
    row["err64_cudnn"], row["rel_err64_cudnn"] = row_errors(gpu.cp.from_dlpack(out), want, rows)
    row["cudnn_correct"] = row["rel_err64_cudnn"] <= tol  # reported, not our kernel: no exit status
    if not row["cudnn_correct"]:
        row["notes"].append(f"cuDNN WRONG: relative error {row['rel_err64_cudnn']:.1e}; not timed")
        return []
    return [Timed("cudnn", call, _systems.Clock.for_torch(gpu), context)]


# -------------------------------------------------------------------------------------- report
TABLE_HEADER = ["kernel", "mask", "N", "B", "grid", "tiles", "lists", "max|diff|", "err64", "ms persistent",
                "ms one-per-tile", "ms grid-stride", "ms wgmma", "ms cuDNN", "one/pers", "cuDNN/pers"]


def _yes_no(flag: Optional[bool]) -> str:
    return "-" if flag is None else ("y" if flag else "n")


def _ms(row: dict, name: str, correct: Optional[bool]) -> str:
    return "WRONG" if correct is False else _num(row[f"ms_{name}"], ".4f")


def table_row(row: dict) -> list[str]:
    """One table line; WRONG where a check failed (not timed, no ratio)."""
    wrong = row["correct"] is False
    return [row["kernel"] or "-", row["mask"], str(row["seq_len"]), str(row["batch"]), _num(row["grid"], "d"),
            _num(row["tiles"], "d"), _yes_no(row["lists"]), _num(row["max_diff"], ".1e"), _num(row["err64"], ".1e"),
            *(_ms(row, name, row["correct"]) for name in ("persistent", "one_per_tile", "grid_stride")),
            _ms(row, "wgmma", row["wgmma_correct"]), _ms(row, "cudnn", row["cudnn_correct"]),
            "WRONG" if wrong else _num(row["one_over_persistent"], ".3f"),
            "WRONG" if wrong or row["cudnn_correct"] is False else _num(row["cudnn_over_persistent"], ".3f")]


def progress_line(row: dict) -> str:
    times = ", ".join(f"{name} {row[f'ms_{name}']:.4f} ms" for name in
                      ("persistent", "one_per_tile", "grid_stride", "wgmma", "cudnn") if row[f"ms_{name}"] is not None)
    check = {True: "ok", False: "WRONG", None: "not checked"}[row["correct"]]
    return (f"  {row['kernel'] or '-'} grid {_num(row['grid'], 'd')} tiles {_num(row['tiles'], 'd')} "
            f"lists {_yes_no(row['lists'])}: {check}, "
            f"max|diff| {_num(row['max_diff'], '.1e')}, err64 {_num(row['err64'], '.1e')}"
            + (f"; {times}" if times else "") + "".join(f"\n    {note}" for note in row["notes"]))


def write_rows(path: str, meta: dict, args: argparse.Namespace, rows: list[dict]) -> None:
    doc = {**meta, "seed": args.seed, "rounds": args.rounds, "reps": args.reps, "heads": HEADS, "dtype": DTYPE,
           "rows": rows}
    _report.write_json(Path(path), doc)


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT_CASES),
                    help=f"comma-separated {CASE_FORMAT} (masks: {', '.join(MASKS)}); default: the 9 first measured")
    ap.add_argument("--rounds", type=int, default=9, help="round-robin rounds (the median is kept)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per launch and round")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seeds the inputs and the document lengths")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("--no-torch", action="store_true", help="no cuDNN column (torch is not imported)")
    ap.add_argument("--no-wgmma", action="store_true", help="no wgmma column")
    ap.add_argument("--dry-run", action="store_true", help="print the cases' tma plans for sm_90; no GPU needed")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    print(f"seed {args.seed}")
    if args.dry_run:
        return dry_run(args.cases, args.seed)
    from omnicupy.dispatch.arch import current_arch, has_wgmma

    if not omnicupy.arrays.gpu_available() or not has_wgmma(current_arch()):
        print("this A/B needs an sm_90 GPU (the tma family); --dry-run plans without one", file=sys.stderr)
        return 2
    gpu = _systems.Gpu(want_torch=not args.no_torch)
    print(f"device {gpu.name}; {DTYPE}, H={HEADS}; {args.rounds} rounds x {args.reps} calls per launch"
          + ("" if gpu.torch is not None else f"; no cuDNN column ({gpu.torch_problem})"), flush=True)
    meta = gpu.meta() if args.json else {}
    rows: list[dict] = []
    for case in args.cases:
        print(case.label, flush=True)
        try:
            row = run_case(gpu, case, args)
        except Exception as exc:  # noqa: BLE001 - one failing case does not stop the others
            traceback.print_exc()
            row = empty_row(case)
            row["correct"] = False
            row["notes"].append(f"error: {type(exc).__name__}: {str(exc)[:200]}")
        rows.append(row)
        print(progress_line(row), flush=True)
        gpu.free()
        if args.json:
            write_rows(args.json, meta, args, rows)
    print(f"\ntma persistent CTAs A/B, {DTYPE}, H={HEADS}, seed {args.seed}: GPU ms per call "
          "(ratios > 1: persistent is faster; WRONG: failed the check, not timed)")
    print(format_table(TABLE_HEADER, [table_row(r) for r in rows], left=2))
    wrong = [r for r in rows if r["correct"] is False or r["wgmma_correct"] is False]
    if wrong:
        print(f"{len(wrong)} case(s) WRONG: " + "; ".join(f"{r['mask']} N={r['seq_len']} D={r['head_dim']}"
                                                         for r in wrong), file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
