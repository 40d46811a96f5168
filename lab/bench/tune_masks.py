"""Kernel configurations side by side with flex on the benchmark's masks: the tuning loop for the
mask-specific targets (the harness's cases, inputs, reference check and timing; one process).

    PYTHONPATH=. python3 lab/bench/tune_masks.py --masks sliding_window,interleaved --head-dims 64 \\
        --configs 'base|64=128:64:8:p4|64=128:128:8|sched=natural'

A config is ';'-joined items: ``D=br:bc:warps[:o][:pN]`` sets the wgmma tile for head dim D
(``o``: overlapped P V, ``pN``: every N-th n8 tile's exp2 on the FMA pipe), ``sched=lpt|natural``
the q tile order (OMNICUPY_SCHEDULE), ``mma=sync|wgmma|auto`` the family. ``base`` is the
shipped configuration. A config that changes nothing for a case's head dim is not rerun there.
The table printed last has TFLOP/s and the ratio to flex.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import _cases, _systems  # noqa: E402

ENV_KEYS = {"sched": "OMNICUPY_SCHEDULE", "mma": "OMNICUPY_MMA"}


@dataclass
class Config:
    label: str
    tiles: dict = field(default_factory=dict)  # head_dim -> tiles.Tile
    env: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Config":
        from omnicupy.dispatch import tiles

        cfg = cls(text)
        for item in filter(None, text.split(";")):
            if item == "base":
                continue
            key, _, value = item.partition("=")
            if key in ENV_KEYS:
                cfg.env[ENV_KEYS[key]] = value
                continue
            cfg.tiles[int(key)] = tiles.Tile.parse(value)
        return cfg

    def applies(self, head_dim: int) -> bool:
        return not self.tiles or head_dim in self.tiles or bool(self.env)

    @contextlib.contextmanager
    def active(self, head_dim: int):
        from omnicupy.dispatch import tiles

        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            with tiles.use_tiles({(head_dim, 2): self.tiles[head_dim]} if head_dim in self.tiles else {}, family="wgmma"):
                yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class Configured(_systems.Omnicupy):
    """omnicupy under a config; its name gains the kernel that the call really selects (a tile that
    does not divide the mask's block sizes falls back to another one)."""

    def __init__(self, cfg: Config, head_dim: int) -> None:
        super().__init__(cfg.label, None)
        self.cfg, self.head_dim = cfg, head_dim

    def context(self):
        return self.cfg.active(self.head_dim)

    def prepare(self, case, mask, bench):
        from omnicupy import jit
        from omnicupy.dispatch import tiles

        bm = bench.omnicupy_mask(mask)
        v = tiles.select_variant(case.head_dim, case.dtype, None, bm.q_block_size, bm.kv_block_size,
                                 bm.features.causal, bm.features.partial, arch=jit.device_arch())
        self.name = f"{self.cfg.label} [{short_name(v)}]"
        return super().prepare(case, mask, bench)


def short_name(v) -> str:
    flags = "".join(f for f, on in (("o", v.overlap), (f"p{v.poly_exp}", v.poly_exp)) if on)
    return f"{v.family} {v.br}x{v.bc}w{v.warps}{flags}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", default="sliding_window,interleaved,document")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--configs", default="base", help="'|'-separated configs (see above)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    configs = [Config.parse(c) for c in args.configs.split("|")]
    gpu = _systems.Gpu(want_torch=not args.no_flex)
    bench = _systems.Bench(gpu, warmup=args.warmup, rep=args.rep, check=True, mask_repeats=0, cache_label="warm",
                           log=lambda m: print(m, flush=True))
    print(f"device: {gpu.meta()['device']}", flush=True)
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        case0 = _cases.Case("full", args.seq_len, head_dim, args.dtype, _cases.batch_for(args.seq_len))
        bench.inputs = None
        gpu.free()
        bench.inputs = _systems.make_inputs(gpu, case0, seed=_cases.SEED + head_dim)
        for mask_name in args.masks.split(","):
            case = _cases.Case(mask_name, args.seq_len, head_dim, args.dtype, case0.batch)
            mask = _cases.make_mask(mask_name, args.seq_len)
            ref: dict = {}

            def reference():
                if "r" not in ref:
                    ref["r"] = _systems.Reference(mask, case, bench.inputs, seed=_cases.SEED)
                return ref["r"]

            systems = [] if args.no_flex or gpu.torch is None else _systems.make_systems([_cases.FLEX])
            systems += [Configured(c, head_dim) for c in configs if c.applies(head_dim)]
            for system in systems:
                try:
                    row = bench.run(system, case, mask, reference)
                except Exception as exc:  # noqa: BLE001 - record and go on
                    print(f"  {system.name}: ERROR {type(exc).__name__}: {exc}", flush=True)
                    continue
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\n{'mask':>15} {'D':>4} {'system':>44} {'TFLOP/s':>8} {'/flex':>6}")
    flex = {(r["mask"], r["head_dim"]): r["tflops"] for r in rows if r["system"] == _cases.FLEX}
    for r in rows:
        f = flex.get((r["mask"], r["head_dim"]))
        ratio = f"{r['tflops'] / f:.3f}" if f and r["tflops"] else "-"
        tf = "WRONG" if r["tflops"] is None else f"{r['tflops']:.1f}"
        print(f"{r['mask']:>15} {r['head_dim']:>4} {r['system'][-44:]:>44} {tf:>8} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
