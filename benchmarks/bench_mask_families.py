"""The attention-gym mask families as FlexAttention users run them: omnicupy (mask_mods compiled by
``compile_mask`` inside ``BlockMask.from_mask_mod``) against FlexAttention (``create_block_mask(...,
_compile=True)`` and ``torch.compile(flex_attention)``), on the same Python mask_mod source.

    python benchmarks/bench_mask_families.py --quick --out fam.json          # N 8192, D 128 (< 8 min)
    python benchmarks/bench_mask_families.py --out fam.json                  # N 8192, 32768; D 64, 128
    python benchmarks/bench_mask_families.py --causal-builds --out causal.json

Per family, N and D (B = 2, H = 16, fp16): the build of each system, cold (its first build of this
family and N in the process: compiles included) and warm (median of ``--builds`` further builds of a
fresh instance of the family, as a training step that rebuilds its mask every batch; omnicupy's
uncompiled path too, for comparison); then forward,
backward and forward+backward, each checked first against a float64 reference (sampled output rows;
gradients of two heads in full where N <= --grad-check-max-n) and timed with triton's do_bench
(median). ``--causal-builds``: ``causal=True`` against ``BlockMask.from_mask_mod(masks.causal())``.
The JSON (``--out``) is rewritten after every case, so a run stopped by ``--budget-s`` keeps its rows.
The families' torch form is the same function with its tables moved to torch and ``np`` elementwise
calls mapped to torch (``torch_form``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from omnicupy.mask import families  # noqa: E402

B, H = 2, 16
CHECK_ROWS = 64
TOLERANCE, GRAD_TOLERANCE = 3e-3, 1e-2


def torch_form(fn: Callable, torch: Any, device: str = "cuda") -> Callable:
    """The same mask_mod for torch: closure tables as device tensors, ``np.minimum``/``np.maximum``
    as ``torch.where`` selections (torch's take tensors only), everything else unchanged."""
    shim = types.SimpleNamespace(minimum=lambda a, b: torch.where(a < b, a, b),
                                 maximum=lambda a, b: torch.where(a > b, a, b), abs=abs)
    cells = tuple(types.CellType(torch.as_tensor(c.cell_contents, device=device)
                                 if isinstance(c.cell_contents, np.ndarray) else c.cell_contents)
                  for c in (fn.__closure__ or ()))
    made = types.FunctionType(fn.__code__, {**fn.__globals__, "np": shim}, fn.__name__, fn.__defaults__,
                              cells or None)
    made.__name__ = fn.__name__
    return made


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N 8192, D 128, fewer repeats (under 8 minutes on an H200)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--families", nargs="+", default=list(families.FAMILY_NAMES), choices=families.FAMILY_NAMES)
    p.add_argument("--builds", type=int, default=5, help="warm builds per system (median)")
    p.add_argument("--grad-check-max-n", type=int, default=8192)
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    p.add_argument("--causal-builds", action="store_true", help="causal=True against from_mask_mod(masks.causal())")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.head_dims, args.builds = [8192], [128], 3
        args.budget_s = args.budget_s or 420.0
    return args


class Run:
    """The GPU side: CuPy, torch, timing, checks, and the results written as they come."""

    def __init__(self, args: argparse.Namespace) -> None:
        import cupy as cp
        import torch
        from triton.testing import do_bench

        self.args, self.cp, self.torch, self.do_bench = args, cp, torch, do_bench
        self.started = time.perf_counter()
        self.rows: list = []
        self.builds: list = []
        self.errors: list = []
        self._flex = None
        self._create_block_mask = None

    # ------------------------------------------------------------------ helpers
    def over_budget(self) -> bool:
        return self.args.budget_s is not None and time.perf_counter() - self.started > self.args.budget_s

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()
        self.torch.cuda.synchronize()

    def bench(self, fn: Callable[[], Any]) -> float:
        return float(self.do_bench(fn, warmup=25 if self.args.quick else 50, rep=60 if self.args.quick else 150,
                                   return_mode="median"))

    def save(self) -> None:
        if self.args.out is None:
            return
        doc = {"device": self.cp.cuda.runtime.getDeviceProperties(0)["name"].decode(errors="replace"),
               "versions": {"torch": self.torch.__version__, "cupy": self.cp.__version__},
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "batch": B, "heads": H, "dtype": "fp16",
               "rows": self.rows, "builds": self.builds, "errors": self.errors}
        self.args.out.write_text(json.dumps(doc, indent=1))

    def flex(self):
        if self._flex is None:
            import torch._dynamo
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 1000)
            self._flex = self.torch.compile(flex_attention, dynamic=False)
            self._create_block_mask = create_block_mask
        return self._flex

    def timed_build(self, build: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        out = build()
        self.sync()
        return out, (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ builds
    def build_both(self, name: str, n: int) -> tuple:
        """Cold and warm builds of both systems; the masks to run with."""
        import omnicupy

        cbm = self._create_block_mask
        fn, nq, nkv = families.examples(n, [name])[name]
        tmod = torch_form(fn, self.torch)

        def ours(f):
            bm = omnicupy.BlockMask.from_mask_mod(f, None, None, nq, nkv)
            bm.device_metadata()
            return bm

        try:  # not timed here: says whether the build runs the compiled mask
            compiled = omnicupy.compile_mask(fn).cuda.text
        except omnicupy.MaskError as exc:
            compiled = f"not compiled: {exc}"
        bm, ours_cold = self.timed_build(lambda: ours(fn))
        ours_warm = [self.timed_build(lambda: ours(families.examples(n, [name])[name][0]))[1]
                     for _ in range(self.args.builds)]
        from omnicupy.mask import compile_mask as cm

        cm.ENABLED = False  # today's path, for comparison: the mask_mod evaluated through CuPy
        try:
            python_warm = [self.timed_build(lambda: ours(fn))[1] for _ in range(1 + self.args.builds)][1:]
        finally:
            cm.ENABLED = True
        fbm, flex_cold = self.timed_build(lambda: cbm(tmod, None, None, nq, nkv, device="cuda", _compile=True))
        flex_warm = [self.timed_build(lambda: cbm(tmod, None, None, nq, nkv, device="cuda", _compile=True))[1]
                     for _ in range(self.args.builds)]
        entry = {"family": name, "seq_len": n, "q_len": nq, "kv_len": nkv, "compiled": compiled,
                 "omnicupy_cold_ms": round(ours_cold, 3), "omnicupy_warm_ms": round(statistics.median(ours_warm), 3),
                 "omnicupy_uncompiled_warm_ms": round(statistics.median(python_warm), 3),
                 "flex_cold_ms": round(flex_cold, 3), "flex_warm_ms": round(statistics.median(flex_warm), 3),
                 "density": round(float(bm.summary.counts[2] + 0.5 * (bm.summary.counts[1] + bm.summary.counts[3]))
                                  / max(1, sum(bm.summary.counts)), 4)}
        self.builds.append(entry)
        print(f"  build {name} N={n}: omnicupy cold {ours_cold:.1f} warm {entry['omnicupy_warm_ms']:.2f} ms "
              f"(uncompiled {entry['omnicupy_uncompiled_warm_ms']:.2f}); "
              f"flex cold {flex_cold:.1f} warm {entry['flex_warm_ms']:.2f} ms", flush=True)
        return fn, nq, nkv, bm, fbm

    # ------------------------------------------------------------------ checks
    def inputs(self, nq: int, nkv: int, d: int, seed: int):
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn((B, H, nq, d), generator=gen, device="cuda", dtype=torch.float16)
        k, v = (torch.randn((B, H, nkv, d), generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
        dout = torch.randn((B, H, nq, d), generator=gen, device="cuda", dtype=torch.float16)
        return q, k, v, dout

    def forward_error(self, out, fn, q, k, v) -> float:
        from omnicupy import reference

        nq, nkv = q.shape[2], k.shape[2]
        rng = np.random.default_rng(nq)
        rows = np.unique(np.concatenate([[0, nq - 1], rng.choice(nq, size=min(nq, CHECK_ROWS), replace=False)]))
        worst = 0.0
        for b, h in ((0, 0), (B - 1, H - 1)):
            allowed = np.broadcast_to(np.asarray(fn(b, h, rows[:, None], np.arange(nkv)[None, :]), dtype=bool),
                                      (len(rows), nkv))
            f64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
            want = reference.attention(f64(q[b, h])[rows][None, None], f64(k[b, h])[None, None],
                                       f64(v[b, h])[None, None], allowed[None, None])[0, 0]
            got = self.torch.as_tensor(out[b, h], device="cuda").double().cpu().numpy()[rows] \
                if not hasattr(out, "get") else out[b, h].get().astype(np.float64)[rows]
            worst = max(worst, reference.relative_error(got, want))
        return worst

    def grad_error(self, grads, fn, q, k, v, dout) -> float:
        """float64 dq, dk, dv of two heads from the element mask, on the GPU with torch."""
        torch = self.torch
        nq, nkv = q.shape[2], k.shape[2]
        allowed = torch.as_tensor(np.broadcast_to(np.asarray(fn(0, 0, np.arange(nq)[:, None],
                                                                np.arange(nkv)[None, :]), dtype=bool), (nq, nkv)),
                                  device="cuda")
        worst = 0.0
        for b, h in ((0, 0), (B - 1, H - 1)):
            qh, kh, vh, dh = (t[b, h].double() for t in (q, k, v, dout))
            s = torch.where(allowed, qh @ kh.T / math.sqrt(q.shape[-1]), -torch.inf)
            m = s.max(dim=1, keepdim=True).values
            p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
            p = p / torch.where(p.sum(1, keepdim=True) > 0, p.sum(1, keepdim=True), 1.0)
            dp = dh @ vh.T
            ds = p * (dp - (p * dp).sum(1, keepdim=True))
            want = (ds @ kh / math.sqrt(q.shape[-1]), ds.T @ qh / math.sqrt(q.shape[-1]), p.T @ dh)
            for g, w in zip(grads, want):
                got = torch.as_tensor(g[b, h], device="cuda").double()
                if not bool(torch.isfinite(got).all()):
                    return float("inf")
                worst = max(worst, float((got - w).norm() / w.norm()))
        return worst

    # ------------------------------------------------------------------ one case
    def passes(self, label: str, n: int, d: int, fn, ours: dict, theirs: dict, q, k, v, dout) -> None:
        """Check then time each system's forward, backward and forward+backward."""
        for system, calls in (("omnicupy", ours), ("flex", theirs)):
            for pass_name in ("fwd", "bwd", "fwdbwd"):
                row = {"family": label, "system": system, "pass": pass_name, "seq_len": n, "head_dim": d,
                       "ms": None, "correct": None, "error": None}
                try:
                    out = calls[pass_name]()
                    self.sync()
                    if pass_name == "fwd":
                        row["error"] = self.forward_error(out, fn, q, k, v)
                        row["correct"] = row["error"] <= TOLERANCE
                    elif pass_name == "bwd" and q.shape[2] <= self.args.grad_check_max_n:
                        row["error"] = self.grad_error(out, fn, q, k, v, dout)
                        row["correct"] = row["error"] <= GRAD_TOLERANCE
                    del out
                    if row["correct"] is not False:
                        row["ms"] = round(self.bench(calls[pass_name]), 4)
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    row["failed"] = f"{type(exc).__name__}: {exc}"[:500]
                    self.errors.append({"family": label, "system": system, "pass": pass_name, "error": row["failed"]})
                self.rows.append(row)
                print(f"    {system:9s} {pass_name:6s} {row['ms'] if row['ms'] is not None else '-':>9} ms  "
                      f"err {row['error'] if row['error'] is not None else '-'}"
                      f"{'  FAILED ' + row['failed'] if 'failed' in row else ''}", flush=True)
        self.save()

    def systems(self, bm, fbm, q, k, v, dout, causal: bool = False):
        import cupy as cp
        import omnicupy

        torch, flex = self.torch, self.flex()
        cq, ck, cv, cd = (cp.from_dlpack(t) for t in (q, k, v, dout))
        mask = None if causal else bm
        saved = omnicupy.attention(cq, ck, cv, mask, causal=causal, return_lse=True)
        ours = {"fwd": lambda: omnicupy.attention(cq, ck, cv, mask, causal=causal),
                "bwd": lambda: omnicupy.attention_backward(cd, cq, ck, cv, *saved, mask, causal=causal),
                "fwdbwd": lambda: omnicupy.attention_backward(
                    cd, cq, ck, cv, *omnicupy.attention(cq, ck, cv, mask, causal=causal, return_lse=True), mask,
                    causal=causal)}
        if fbm is None:
            return ours, {}
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        out = flex(*leaves, block_mask=fbm)
        theirs = {"fwd": lambda: flex(q, k, v, block_mask=fbm),
                  "bwd": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                  "fwdbwd": lambda: torch.autograd.grad(flex(*leaves, block_mask=fbm), leaves, dout)}
        return ours, theirs

    def families_run(self) -> None:
        self.flex()
        for n in self.args.sizes:
            for name in self.args.families:
                if self.over_budget():
                    print(f"budget of {self.args.budget_s:.0f} s spent: stopping before {name} N={n}", flush=True)
                    return
                try:
                    fn, nq, nkv, bm, fbm = self.build_both(name, n)
                except Exception as exc:  # noqa: BLE001
                    self.errors.append({"family": name, "seq_len": n, "error": f"build: {type(exc).__name__}: {exc}"})
                    print(f"  build {name} N={n} FAILED: {exc}", flush=True)
                    continue
                for d in self.args.head_dims:
                    print(f"  {name} N={n} D={d}", flush=True)
                    q, k, v, dout = self.inputs(nq, nkv, d, seed=n + d)
                    ours, theirs = self.systems(bm, fbm, q, k, v, dout)
                    self.passes(name, n, d, fn, ours, theirs, q, k, v, dout)
                    del q, k, v, dout, ours, theirs
                    self.cp.get_default_memory_pool().free_all_blocks()
                    self.torch.cuda.empty_cache()

    def causal_run(self) -> None:
        """causal=True against the same mask built from masks.causal(), omnicupy only."""
        import omnicupy

        causal_fn = lambda b, h, q, kv: q >= kv  # noqa: E731 - the check's element mask
        for n in self.args.sizes:
            bm = omnicupy.BlockMask.from_mask_mod(omnicupy.masks.causal(), None, None, n, n)
            for d in self.args.head_dims:
                q, k, v, dout = self.inputs(n, n, d, seed=n + d)
                for label, mask_bm, causal in (("causal=True", None, True), ("from_mask_mod(causal)", bm, False)):
                    ours, _ = self.systems(mask_bm, None, q, k, v, dout, causal=causal)
                    self.passes(label, n, d, causal_fn, ours, {}, q, k, v, dout)


def table(run: Run) -> str:
    """Build ms and flex/omnicupy time ratios per family, N, D (higher is better for omnicupy)."""
    lines = [f"{'family':18s} {'N':>6s} {'D':>4s} {'build ours/flex warm ms':>24s} {'cold ms':>16s} "
             f"{'fwd x':>6s} {'bwd x':>6s} {'f+b x':>6s}"]
    builds = {(e["family"], e["seq_len"]): e for e in run.builds}
    ms = {(r["family"], r["seq_len"], r["head_dim"], r["system"], r["pass"]): r["ms"] for r in run.rows}
    for fam, n, d in sorted({(r["family"], r["seq_len"], r["head_dim"]) for r in run.rows}):
        e = builds.get((fam, n))
        warm = f"{e['omnicupy_warm_ms']:.2f}/{e['flex_warm_ms']:.2f}" if e else "-"
        cold = f"{e['omnicupy_cold_ms']:.0f}/{e['flex_cold_ms']:.0f}" if e else "-"
        ratios = []
        for p in ("fwd", "bwd", "fwdbwd"):
            ours, theirs = ms.get((fam, n, d, "omnicupy", p)), ms.get((fam, n, d, "flex", p))
            if theirs is None and fam == "from_mask_mod(causal)":
                theirs, ours = ours, ms.get(("causal=True", n, d, "omnicupy", p))  # causal=True / built, as x
            ratios.append(f"{theirs / ours:6.2f}" if ours and theirs else f"{'-':>6s}")
        lines.append(f"{fam:18.18s} {n:6d} {d:4d} {warm:>24s} {cold:>16s} {' '.join(ratios)}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    args = parse(argv)
    run = Run(args)
    if args.causal_builds:
        run.causal_run()
    else:
        run.families_run()
    run.save()
    print(f"\n{time.perf_counter() - run.started:.0f} s; x = flex ms / omnicupy ms (for causal: built / causal=True)")
    print(table(run))
    return 1 if run.errors or any(r["correct"] is False for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
