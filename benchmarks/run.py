"""omnicupy vs FlexAttention, FlashAttention-2 and cuDNN, side by side in one process.

    PYTHONPATH=. python -m benchmarks.run [--quick] [--masks causal,document] [--head-dims 64,128]
        [--seq-lens 8192] [--dtypes fp16,bf16] [--systems omnicupy,flex] [--out DIR] [--budget 540]
        [--pass fwd|bwd|fwdbwd]
    python -m benchmarks.run --dry-run        # the plan and the mask densities, no GPU needed

Every system's output is checked against the float64 reference on sampled rows before it is timed;
a wrong result is reported as WRONG and not timed. Effective TFLOP/s = 4·B·H·(allowed pairs)·D / time,
pairs counted exactly from the element mask. ``--pass bwd`` times the backward alone (gradients of
q, k, v from a saved forward; checked against float64 gradients of two heads; FLOPs 2.5x the
forward's), ``--pass fwdbwd`` both (3.5x); ``--systems ...,omnicupy_det`` adds omnicupy's backward
with deterministic=True. Writes <out>/results.json (after every row),
<out>/results.md, <out>/chart.png, and benchmarks/results/runs/latest.json; prints the table last.
See lab/benchmark-history.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as `python benchmarks/run.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"  # relative imports then work as under `python -m benchmarks.run` (PEP 366)

# Relative: the harness also runs installed, as omnicupy.benchmarks.run (`omnicupy bench`).
from . import _cases, _report  # noqa: E402

#: Each run's folder and latest.json (the last run of this checkout, by construction): scratch, not
#: committed. The committed standing is one file per benchmark in results/ (tools/standing.py).
RESULTS_DIR = Path(__file__).resolve().parent / "results" / "runs"
#: Explicit flags win over --quick.
QUICK = {"seq_lens": (4096,), "head_dims": (128,), "dtypes": ("fp16",), "warmup": 3, "rep": 10}
DEFAULTS = {"masks": _cases.MASK_NAMES, "seq_lens": _cases.DEFAULT_SEQ_LENS, "head_dims": _cases.HEAD_DIMS,
            "dtypes": _cases.DTYPES, "systems": _cases.SYSTEMS, "warmup": 10, "rep": 30}
DTYPE_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


@dataclass
class Config:
    masks: tuple
    head_dims: tuple
    seq_lens: tuple
    dtypes: tuple
    systems: tuple
    warmup: int
    rep: int
    out: Optional[str]
    check: bool
    dry_run: bool
    cold_compile: bool
    budget: Optional[float]
    mask_repeats: int
    chart: bool
    quick: bool
    resume: Optional[str] = None
    report: Optional[str] = None
    pass_name: str = "fwd"


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _choose(parser, flag: str, text: Optional[str], allowed, convert=str, expect: str = "") -> Optional[tuple]:
    """Parse 'a,b,c' (or 'all') against ``allowed``; None when the flag was not given."""
    if text is None:
        return None
    if text.strip() == "all":
        return tuple(allowed)
    picked = []
    for item in _split(text):
        try:
            value = convert(item)
        except (ValueError, KeyError):
            parser.error(f"{flag}: cannot read {item!r}")
        if value not in allowed:
            parser.error(f"{flag}: {item!r} is not {expect or 'one of ' + ', '.join(map(str, allowed))}")
        if value not in picked:
            picked.append(value)
    if not picked:
        parser.error(f"{flag}: empty list")
    return tuple(picked)


class _AnySeqLen(tuple):
    """Allowed sequence lengths: any positive multiple of the block size (the usual ones in --help)."""

    def __contains__(self, value) -> bool:  # type: ignore[override]
        return isinstance(value, int) and value > 0 and value % _cases.BLOCK == 0


def build_parser() -> argparse.ArgumentParser:
    from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS

    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masks", help=f"comma list or 'all' (default all): {', '.join(_cases.MASK_NAMES)}")
    p.add_argument("--head-dims", help=f"comma list (default {','.join(map(str, _cases.HEAD_DIMS))}; "
                                       f"supported {','.join(map(str, SUPPORTED_HEAD_DIMS))})")
    p.add_argument("--seq-lens", help=f"comma list of N, multiples of {_cases.BLOCK} (default 8192; usual "
                                      f"{','.join(map(str, _cases.SEQ_LENS))}); "
                                      f"batch = max(1, {_cases.TOKENS} // N), {_cases.HEADS} heads")
    p.add_argument("--dtypes", help="comma list (default fp16,bf16)")
    p.add_argument("--systems", help=f"comma list or 'all' (default all): {', '.join(_cases.SYSTEMS)}; also "
                                     f"{', '.join(_cases.EXTRA_SYSTEMS)} (backward with deterministic=True)")
    p.add_argument("--pass", dest="pass_name", choices=_cases.PASSES, default="fwd",
                   help="what to time: fwd (default), bwd (the backward from a saved forward), fwdbwd (both)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: N=4096, D=128, fp16, all masks, 3 warm-up / 10 timed calls (explicit flags win)")
    p.add_argument("--out", help="output folder (default benchmarks/results/runs/<UTC time>)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness check (rows then have correct: null)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and mask densities (CPU only) and exit")
    p.add_argument("--cold-compile", action="store_true",
                   help="fresh temporary kernel caches (omnicupy, inductor, triton) so first calls include compiling")
    p.add_argument("--warmup", type=int, help="warm-up calls per measurement (default 10)")
    p.add_argument("--rep", type=int, help="timed calls per measurement, median reported (default 30)")
    p.add_argument("--budget", type=float, help="seconds: start no new case after this (default: no limit)")
    p.add_argument("--mask-repeats", type=int, default=3, help="timed mask builds after the first (default 3)")
    p.add_argument("--no-chart", dest="chart", action="store_false", help="do not draw chart.png")
    p.add_argument("--resume", metavar="RESULTS_JSON",
                   help="keep the rows of an earlier results.json and run only the cases it lacks")
    p.add_argument("--report", metavar="RESULTS_JSON",
                   help="no run: print the table of a results.json (with --out: also results.md, chart.png)")
    return p


def parse_args(argv=None) -> Config:
    from omnicupy.dispatch.variant import SUPPORTED_HEAD_DIMS

    parser = build_parser()
    a = parser.parse_args(argv)
    picked = {
        "masks": _choose(parser, "--masks", a.masks, _cases.MASK_NAMES),
        "head_dims": _choose(parser, "--head-dims", a.head_dims, SUPPORTED_HEAD_DIMS, int),
        "seq_lens": _choose(parser, "--seq-lens", a.seq_lens, _AnySeqLen(_cases.SEQ_LENS), int,
                            expect=f"a positive multiple of {_cases.BLOCK}"),
        "dtypes": _choose(parser, "--dtypes", a.dtypes, _cases.DTYPES, lambda s: DTYPE_ALIASES[s.lower()]),
        "systems": _choose(parser, "--systems", a.systems, _cases.SYSTEMS + _cases.EXTRA_SYSTEMS),
        "warmup": a.warmup,
        "rep": a.rep,
    }
    for key, value in picked.items():
        if value is None:
            picked[key] = QUICK[key] if a.quick and key in QUICK else DEFAULTS[key]
    if picked["warmup"] < 0 or picked["rep"] < 1:
        parser.error("--warmup must be >= 0 and --rep >= 1")
    if a.mask_repeats < 0:
        parser.error("--mask-repeats must be >= 0")
    if a.budget is not None and a.budget <= 0:
        parser.error("--budget must be positive")
    if a.systems is not None and a.systems.strip() == "all":  # the extra systems only when named
        picked["systems"] = _cases.SYSTEMS
    return Config(out=a.out, check=a.check, dry_run=a.dry_run, cold_compile=a.cold_compile, budget=a.budget,
                  mask_repeats=a.mask_repeats, chart=a.chart, quick=a.quick, resume=a.resume, report=a.report,
                  pass_name=a.pass_name, **picked)


def log(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------- dry run
def dry_run(cfg: Config) -> int:
    """The plan, computed on the CPU: mask densities (exact pair counts), builders, cases, systems."""
    import importlib.util

    log("omnicupy benchmark plan (dry run: nothing runs on a GPU)")
    torch_found = importlib.util.find_spec("torch") is not None
    log(f"systems: {', '.join(cfg.systems)}" + ("" if torch_found else "  (torch not found here: omnicupy only)"))
    log(f"timing: {cfg.warmup} warm-up + {cfg.rep} timed calls, median; check: {'on' if cfg.check else 'off'}")
    masks_mod = _cases.masks_module()
    if masks_mod is None:
        log("note: omnicupy.masks does not import; omnicupy would build from the benchmark's rules")
    log(f"{'mask':15s} {'N':>6s} {'density':>8s} {'pairs':>12s}  {'flex mask_mod':14s}  omnicupy builds from")
    for n in cfg.seq_lens:
        for name in cfg.masks:
            mask = _cases.make_mask(name, n)
            pairs = _cases.count_pairs(mask.array_mod(), n)
            _, source, note = _cases.resolve_product_mod(mask, masks_mod)
            if name in ("full", "causal"):  # the built-in builders, as attention(causal=True) uses
                source = f"BlockMask.{name}"
            flex_how = "dense[q, kv]" if mask.flex_dense else "rule"
            log(f"{name:15s} {n:6d} {_cases.density(pairs, n):8.4f} {pairs:12d}  {flex_how:14s}  {source}"
                + (f"  [{note}]" if note else ""))
    if any(_cases.make_mask(m, 1024).flex_dense for m in cfg.masks):
        log("flex mask_mod 'dense[q, kv]': the rule evaluated once into a bool [N, N] tensor (flex cannot "
            "compile the random rule inline)")
    cases = _cases.plan(cfg.masks, cfg.head_dims, cfg.seq_lens, cfg.dtypes, cfg.pass_name)
    log(f"cases: {len(cases)} (pass: {cfg.pass_name})")
    for case in cases:
        run = [s for s in cfg.systems if _cases.skip_reason(s, case) is None]
        skipped = sorted({_cases.skip_reason(s, case) for s in cfg.systems} - {None})
        log(f"  {case.key}: {' '.join(run) or '(none)'}" + (f"  (skips: {'; '.join(skipped)})" if skipped else ""))
    return 0


# --------------------------------------------------------------------------- the run
def _setup_caches(cfg: Config) -> tuple[str, Optional[str]]:
    """(label for first-call times, temporary folder to remove afterwards)."""
    if not cfg.cold_compile:
        from omnicupy.jit import env

        return f"existing caches (omnicupy: {env.cache_dir()})", None
    tmp = tempfile.mkdtemp(prefix="omnicupy-bench-")
    os.environ["OMNICUPY_CACHE_DIR"] = os.path.join(tmp, "omnicupy")
    label = "cold (fresh omnicupy cache)"
    if "torch" not in sys.modules:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        label = "cold (fresh omnicupy, inductor and triton caches)"
    return label, tmp


def _out_dir(cfg: Config) -> Path:
    if cfg.out:
        return Path(cfg.out)
    return RESULTS_DIR / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def run(cfg: Config) -> int:
    from omnicupy import arrays

    if not arrays.gpu_available():
        print("benchmarks: no usable NVIDIA GPU here (CuPy sees none). `python -m benchmarks.run --dry-run` "
              "shows the plan without one.", file=sys.stderr, flush=True)
        return 1
    cache_label, tmp = _setup_caches(cfg)
    try:
        return _run(cfg, cache_label)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(cfg: Config, cache_label: str) -> int:
    from . import _systems

    started = time.perf_counter()
    systems = _systems.make_systems(list(cfg.systems))
    gpu = _systems.Gpu(want_torch=any(s.needs_torch for s in systems))
    if gpu.torch is None and any(s.needs_torch for s in systems):
        log(f"torch unavailable ({gpu.torch_problem}): running omnicupy alone")
        systems = [s for s in systems if not s.needs_torch]
    meta = gpu.meta()
    out = _out_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    log(f"device: {meta['device']} (driver {meta['driver']}); {meta['versions']}")
    log(f"writing {out / 'results.json'}; first-call times with {cache_label}")

    bench = _systems.Bench(gpu, warmup=cfg.warmup, rep=cfg.rep, check=cfg.check, mask_repeats=cfg.mask_repeats,
                           cache_label=cache_label, log=log)
    rows: list[dict] = []
    errors: list[dict] = []
    config = {k: v for k, v in asdict(cfg).items()}
    config.update(batch_tokens=_cases.TOKENS, heads=_cases.HEADS, block_size=_cases.BLOCK,
                  tolerance=_systems.TOLERANCE, cache=cache_label, systems=[s.name for s in systems], out=str(out))

    def save(finished: bool = False) -> None:
        doc = _report.document(meta, rows, config=config, finished=finished, errors=errors, masks=bench.mask_info,
                               mask_build=bench.mask_build, first_call=bench.first_call)
        _report.write_json(out / "results.json", doc)
        try:
            _report.write_json(RESULTS_DIR / "latest.json", doc)
        except OSError as exc:  # a read-only source tree must not stop the run
            log(f"note: could not write {RESULTS_DIR / 'latest.json'}: {exc}")

    done: set = set()
    if cfg.resume:
        previous = _load_previous(cfg.resume)
        rows.extend(previous.get("rows", []))
        bench.mask_build.extend(previous.get("mask_build", []))
        bench.first_call.extend(previous.get("first_call", []))
        done = {_row_key(r["system"], r) for r in rows}
        config["resumed_from"] = str(cfg.resume)
        log(f"resuming from {cfg.resume}: {len(rows)} rows kept, their cases are not run again")

    cases = _cases.plan(cfg.masks, cfg.head_dims, cfg.seq_lens, cfg.dtypes, cfg.pass_name)
    masks: dict = {}
    shape = None
    finished = True
    save()
    try:
        for i, case in enumerate(cases):
            if cfg.budget is not None and time.perf_counter() - started > cfg.budget:
                finished = False
                log(f"budget of {cfg.budget:.0f} s reached: {len(cases) - i} cases not run "
                    f"(rerun with --resume {out / 'results.json'} to continue)")
                break
            todo = [s for s in systems
                    if _cases.skip_reason(s.name, case) is None and _row_key(s.name, asdict(case)) not in done]
            if not todo:
                continue
            if shape != (case.dtype, case.head_dim, case.seq_len):
                shape = (case.dtype, case.head_dim, case.seq_len)
                bench.inputs = None
                gpu.free()
                try:
                    bench.inputs = _systems.make_inputs(gpu, case, seed=_cases.SEED + case.head_dim)
                except Exception:  # noqa: BLE001
                    message = _systems.print_exception(f"inputs for {case.key}")
                    log(f"inputs for {case.key} failed: {message}")
            if bench.inputs is None:
                errors.extend(_error(s.name, case, "no inputs (allocation failed)") for s in todo)
                save()
                continue
            _run_case(cfg, bench, todo, case, masks, rows, errors, started, save)
    except KeyboardInterrupt:
        finished = False
        log("interrupted: writing what was measured")
    bench.inputs = None
    save(finished=finished)
    _finish(cfg, out, meta, rows, errors, bench.mask_build, bench.first_call, cache_label, latest=True)
    return 0


def _row_key(system: str, row: dict) -> tuple:
    # rows carry "pass"; a Case (asdict) carries "pass_name"
    return (system, row["mask"], row["head_dim"], row["seq_len"], row["dtype"],
            row.get("pass", row.get("pass_name", "fwd")))


def _load_previous(path: str) -> dict:
    import json

    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise SystemExit(f"--resume {path}: not a results.json (no 'rows' list)")
    missing = [k for r in doc["rows"] for k in _report.ROW_KEYS if k not in r]
    if missing:
        raise SystemExit(f"--resume {path}: rows lack keys {sorted(set(missing))}")
    return doc


def _error(system: str, case: _cases.Case, message: str) -> dict:
    return {"system": system, "mask": case.mask, "head_dim": case.head_dim, "seq_len": case.seq_len,
            "dtype": case.dtype, "error": message}


def _run_case(cfg, bench, systems, case, masks, rows, errors, started, save) -> None:
    from . import _systems

    key = (case.mask, case.seq_len)
    if key not in masks:
        masks[key] = _cases.make_mask(case.mask, case.seq_len)
    mask = masks[key]
    try:
        dens = f"{_cases.density(bench.pairs(mask), case.seq_len):.3f}"
    except Exception:  # noqa: BLE001
        dens = "?"
        _systems.print_exception(f"pair count for {case.key}")
    log(f"[{time.perf_counter() - started:7.1f} s] {case.key} density {dens} ({mask.label})")
    reference: dict = {}

    def get_reference():
        if "value" not in reference:
            reference["value"] = _systems.reference_for(mask, case, bench, seed=_cases.SEED)
        return reference["value"]

    for system in systems:
        if _cases.skip_reason(system.name, case):
            continue
        try:
            rows.append(bench.run(system, case, mask, get_reference))
        except Exception:  # noqa: BLE001 - one system's failure must not stop the others
            message = _systems.print_exception(f"{system.name} on {case.key}")
            log(f"  {system.name:16s} ERROR {message.splitlines()[0][:200]}")
            errors.append(_error(system.name, case, message))
        save()


def _finish(cfg, out: Optional[Path], meta, rows, errors, mask_build, first_call, cache_label, *,
            latest: bool) -> None:
    """Summaries, then results.md and the chart (when ``out``), then the table last."""
    table = _report.format_table(rows, errors)
    passes = sorted({r.get("pass", "fwd") for r in rows} - {"fwd"})
    builds = _build_table(mask_build)
    firsts = _first_call_summary(first_call)
    wrong = [r for r in rows if r["correct"] is False]
    md = [f"# omnicupy benchmark: {meta['device']}, {meta['date']}", "",
          f"driver {meta['driver']}; {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}", "",
          "Effective TFLOP/s (4·B·H·allowed pairs·D / median time"
          + "".join(f", times {_cases.PASS_FLOPS[p]} for pass {p}" for p in passes)
          + "); WRONG = failed the check, err = raised, - = not run.", "", table, "", "## Mask construction (ms)", "", builds, "",
          f"## First call (s; {cache_label})", "", firsts, ""]
    chart = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text("\n".join(md))
    if out is not None and cfg.chart:
        try:
            chart = _report.write_chart(rows, out / "chart.png", title=f"{meta['device']} {meta['date'][:10]}")
        except Exception:  # noqa: BLE001
            from . import _systems

            _systems.print_exception("chart")
        if chart is not None and latest:
            try:
                shutil.copyfile(chart, RESULTS_DIR / "latest.png")
            except OSError:
                pass
    log("")
    log("mask construction (ms):")
    log(builds)
    log(f"first call (s; {cache_label}):")
    log(firsts)
    if errors:
        log(f"{len(errors)} errors (tracebacks on stderr; messages in results.json):")
        for e in errors:
            log(f"  {e['system']} {e['mask']} D={e['head_dim']} N={e['seq_len']} {e['dtype']}: "
                f"{e['error'].splitlines()[0][:160]}")
    if wrong:
        log(f"{len(wrong)} WRONG results: " + ", ".join(f"{r['system']}/{r['mask']}/D{r['head_dim']}/{r['dtype']}"
                                                      for r in wrong))
    if out is not None:
        log(f"results: {out / 'results.json'}, {out / 'results.md'}" + (f", {chart}" if chart else ""))
    log("")
    log(f"{meta['device']}, {meta['date']}: effective TFLOP/s")
    log(table)


def _build_table(entries: list[dict]) -> str:
    """Mask construction per (mask, N): steady state (median of the repeats) and the first build,
    which carries one-time costs (``*``: the system's first build in its process)."""
    by_mask: dict = {}
    for e in entries:
        by_mask.setdefault((e["mask"], e["seq_len"]), {})[e["system"]] = e
    lines = ["| mask | N | omnicupy steady | omnicupy first | flex steady | flex first |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for (mask, n), got in by_mask.items():
        cells = []
        for system in ("omnicupy", "flex"):
            e = got.get(system)
            steady = None if e is None else e.get("steady_ms", e.get("ms"))  # "ms": older results.json
            first = None if e is None else e.get("first_ms")
            cells.append("-" if steady is None else f"{steady:.2f}")
            cells.append("-" if first is None else f"{first:.2f}" + ("*" if e.get("first_in_process") else ""))
        lines.append(f"| {mask} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "steady = median of the repeated builds; first = the first build of that mask at that N, "
              "one-time costs included (* = the system's first build in the process, which also pays for "
              "e.g. CuPy compiling its elementwise kernels)."]
    return "\n".join(lines)


def _first_call_summary(entries: list[dict]) -> str:
    by_system: dict = {}
    for e in entries:
        by_system.setdefault(e["system"], []).append(e["seconds"])
    lines = ["| system | calls | median s | max s |", "| --- | ---: | ---: | ---: |"]
    for system, secs in by_system.items():
        lines.append(f"| {system} | {len(secs)} | {_report.median(secs):.3f} | {max(secs):.3f} |")
    return "\n".join(lines)


def report(cfg: Config) -> int:
    """Table (and, with --out, results.md and chart.png) from an earlier results.json; no GPU."""
    doc = _load_previous(cfg.report)
    meta = {k: doc.get(k) or "?" for k in ("device", "driver", "date")}
    meta["versions"] = doc.get("versions") or {}
    cache_label = (doc.get("config") or {}).get("cache", "?")
    _finish(cfg, Path(cfg.out) if cfg.out else None, meta, doc["rows"], doc.get("errors", []),
            doc.get("mask_build", []), doc.get("first_call", []), cache_label, latest=False)
    return 0


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.report:
        return report(cfg)
    if cfg.dry_run:
        return dry_run(cfg)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
