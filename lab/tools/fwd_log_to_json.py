"""One-off: the forward standing run of 2026-11-24 22:54 UTC was kept only as its log
(lab/results/fwd_h200_2254.txt); rebuild the harness's results.json rows of its first process from
the log's per-system lines, so that benchmarks/results/forward.json has the harness's format.

    python3 lab/tools/fwd_log_to_json.py lab/results/fwd_h200_2254.txt benchmarks/results/forward.json
"""
from __future__ import annotations

import ast
import json
import re
import sys

CASE = re.compile(r"^\[\s*[\d.]+ s\] (\w+) D=(\d+) N=(\d+) (\w+) B=(\d+) H=(\d+) density ([\d.]+)")
SYSTEM = re.compile(r"^  (\w+)\s+([\d.]+) TFLOP/s\s+([\d.]+) ms\s+err ([\d.e+-]+)")
HEADER = re.compile(r"^######## (\w+): (.+), (\S+Z):$")
DEVICE = re.compile(r"^device: (.+) \(driver ([\d.]+)\); (\{.*\})$")


def convert(lines: list[str], process: str = "fwd") -> dict:
    doc: dict = {"rows": [], "finished": True, "errors": [],
                 "source": f"rebuilt from the log of process {process!r} by lab/tools/fwd_log_to_json.py"}
    inside, case = False, None
    for line in lines:
        head = HEADER.match(line)
        if head:
            inside = head.group(1) == process
            if inside:
                doc["date"] = head.group(3)
            continue
        if not inside:
            continue
        dev = DEVICE.match(line)
        if dev:
            doc.update(device=dev.group(1), driver=dev.group(2), versions=ast.literal_eval(dev.group(3)))
        m = CASE.match(line)
        if m:
            case = dict(mask=m.group(1), head_dim=int(m.group(2)), seq_len=int(m.group(3)), dtype=m.group(4),
                        batch=int(m.group(5)), heads=int(m.group(6)), density=float(m.group(7)))
            continue
        s = SYSTEM.match(line)
        if s and case is not None:
            doc["rows"].append({"system": s.group(1), **case, "ms": float(s.group(3)), "tflops": float(s.group(2)),
                                "correct": True, "error": float(s.group(4))})
    return doc


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        result = convert(f.read().splitlines())
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"{len(result['rows'])} rows, {result['date']}")
