"""Results: the row records, the JSON document, the table printed last and the chart.

Pure Python; matplotlib is imported only when a chart is drawn.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable, Optional

from . import _cases

#: The keys of every row, in order. The JSON contract: do not change them.
ROW_KEYS = ("system", "mask", "head_dim", "seq_len", "batch", "heads", "dtype", "density", "ms", "tflops", "correct")

#: Table columns after the case columns: (header, system).
TABLE_SYSTEMS = (("omnicupy", _cases.OMNICUPY), ("stage1/stage2", None), ("flex", _cases.FLEX),
                 ("FA2", _cases.SDPA_FLASH), ("cuDNN", _cases.SDPA_CUDNN))


def make_row(system: str, case: _cases.Case, density: float, pairs: int, ms: Optional[float],
             correct: Optional[bool]) -> dict:
    """One measured (or rejected) system on one case. A wrong result has ms and tflops None."""
    if correct is False:
        ms = None
    flops = _cases.attention_flops(case.batch, case.heads, pairs, case.head_dim) * _cases.PASS_FLOPS[case.pass_name]
    tf = _cases.tflops(flops, ms)
    row = {
        "system": system,
        "mask": case.mask,
        "head_dim": case.head_dim,
        "seq_len": case.seq_len,
        "batch": case.batch,
        "heads": case.heads,
        "dtype": case.dtype,
        "density": round(float(density), 6),
        "ms": None if ms is None else round(float(ms), 6),
        "tflops": None if tf is None else round(tf, 3),
        "correct": correct,
    }
    if case.pass_name != "fwd":  # forward rows keep the keys of earlier results.json files
        row["pass"] = case.pass_name
    return row


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def document(meta: dict, rows: list[dict], **extra: Any) -> dict:
    """The results.json document: meta's device/driver/versions/date, the rows, then extras."""
    doc = {
        "device": meta.get("device"),
        "driver": meta.get("driver"),
        "versions": dict(meta.get("versions", {})),
        "date": meta.get("date"),
        "rows": [{k: row[k] for k in ROW_KEYS} for row in rows],
    }
    for key, value in extra.items():
        if key not in doc:
            doc[key] = value
    return doc


def write_json(path: Path, doc: dict) -> None:
    """Atomic write: a reader (or a timeout) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(x: Any):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


# --------------------------------------------------------------------------- table
def _case_key(row: dict) -> tuple:
    return (row["dtype"], row["head_dim"], row["seq_len"], row["mask"])


def _order(key: tuple) -> tuple:
    dtype, head_dim, seq_len, mask = key
    mask_rank = _cases.MASK_NAMES.index(mask) if mask in _cases.MASK_NAMES else len(_cases.MASK_NAMES)
    dtype_rank = _cases.DTYPES.index(dtype) if dtype in _cases.DTYPES else len(_cases.DTYPES)
    return (dtype_rank, head_dim, seq_len, mask_rank, mask)


def _cell(row: Optional[dict], error: bool) -> str:
    if row is None:
        return "err" if error else "-"
    if row["correct"] is False:
        return "WRONG"
    if row["tflops"] is None:
        return "err" if error else "-"
    return f"{row['tflops']:.0f}" if row["tflops"] >= 100 else f"{row['tflops']:.1f}"


def table_rows(rows: list[dict], errors: Iterable[dict] = ()) -> list[list[str]]:
    """One line per case: mask, D, N, dtype, density, TFLOP/s per system, omnicupy/flex."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault(_case_key(row), {})[row["system"]] = row
    failed: dict[tuple, set] = {}
    for err in errors:
        key = (err.get("dtype"), err.get("head_dim"), err.get("seq_len"), err.get("mask"))
        failed.setdefault(key, set()).add(err.get("system"))
        by_case.setdefault(key, {})
    lines = []
    for key in sorted(by_case, key=_order):
        dtype, head_dim, seq_len, mask = key
        systems = by_case[key]
        bad = failed.get(key, set())
        densities = [r["density"] for r in systems.values() if r.get("density") is not None]
        line = [str(mask), str(head_dim), str(seq_len), str(dtype), f"{densities[0]:.3f}" if densities else "?"]
        for header, system in TABLE_SYSTEMS:
            if system is None:  # the two omnicupy stages in one cell
                stages = [_cell(systems.get(f"omnicupy_stage{s}"), f"omnicupy_stage{s}" in bad) for s in (1, 2)]
                line.append("/".join(stages))
            else:
                line.append(_cell(systems.get(system), system in bad))
        line.append(_ratio(systems.get(_cases.OMNICUPY), systems.get(_cases.FLEX)))
        lines.append(line)
    return lines


def _ratio(ours: Optional[dict], theirs: Optional[dict]) -> str:
    if not ours or not theirs or not ours.get("tflops") or not theirs.get("tflops"):
        return "-"
    return f"{ours['tflops'] / theirs['tflops']:.2f}"


TABLE_HEADER = ["mask", "D", "N", "dtype", "density", *(h for h, _ in TABLE_SYSTEMS), "omnicupy/flex"]


def format_table(rows: list[dict], errors: Iterable[dict] = ()) -> str:
    """A Markdown table (readable in a terminal, pasteable into docs/performance.md), TFLOP/s per system.

    Cells: a number, WRONG (failed the correctness check, not timed), err (raised), - (not run)."""
    body = table_rows(rows, errors)
    table = [TABLE_HEADER, *body]
    widths = [max(len(r[i]) for r in table) for i in range(len(TABLE_HEADER))]
    numeric = set(range(4, len(TABLE_HEADER))) | {1, 2}

    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in numeric else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if i in numeric else "-" * w for i, w in enumerate(widths)) + " |"
    return "\n".join([fmt(TABLE_HEADER), rule, *(fmt(r) for r in body)])


# --------------------------------------------------------------------------- chart
def _headline(rows: list[dict]) -> tuple[Optional[str], Optional[int]]:
    """The (dtype, N) the chart shows: fp16 and 8192 when present, else the first / the largest."""
    dtypes = {r["dtype"] for r in rows}
    seq_lens = {r["seq_len"] for r in rows}
    if not rows:
        return None, None
    dtype = "fp16" if "fp16" in dtypes else sorted(dtypes)[0]
    seq_len = 8192 if 8192 in seq_lens else max(seq_lens)
    return dtype, seq_len


def write_chart(rows: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """Bars of omnicupy vs flex TFLOP/s per mask, one panel per head dim. None when matplotlib
    is missing or there is nothing to draw (a message says which)."""
    dtype, seq_len = _headline(rows)
    picked = [r for r in rows if r["dtype"] == dtype and r["seq_len"] == seq_len and r["tflops"]]
    if not picked:
        print("chart: no timed rows to draw", flush=True)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - any import problem means "no chart"
        print(f"chart: skipped, matplotlib is not usable ({exc})", flush=True)
        return None
    head_dims = sorted({r["head_dim"] for r in picked})
    systems = [s for s in (_cases.OMNICUPY, _cases.FLEX) if any(r["system"] == s for r in picked)]
    fig, axes = plt.subplots(len(head_dims), 1, figsize=(11, 3.2 * len(head_dims)), squeeze=False)
    for ax, head_dim in zip(axes[:, 0], head_dims):
        masks = [m for m in _cases.MASK_NAMES if any(r["mask"] == m and r["head_dim"] == head_dim for r in picked)]
        width = 0.8 / max(1, len(systems))
        for i, system in enumerate(systems):
            values = []
            for mask in masks:
                hit = [r["tflops"] for r in picked if r["system"] == system and r["mask"] == mask
                       and r["head_dim"] == head_dim]
                values.append(hit[0] if hit else 0.0)
            xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(masks))]
            bars = ax.bar(xs, values, width, label=system)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in values], fontsize=7)
        ax.set_xticks(range(len(masks)))
        ax.set_xticklabels(masks, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D={head_dim}, N={seq_len}, {dtype}", fontsize=9)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["ROW_KEYS", "make_row", "document", "write_json", "format_table", "table_rows", "write_chart", "median"]
