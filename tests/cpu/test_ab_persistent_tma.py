"""CPU tests of lab/bench/ab_persistent_tma.py: the dry run's plans, the case parser, and the pieces of
the GPU path that need no GPU (the derived launches' parameter bytes, the float64 reference rows)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lab.bench import ab_persistent_tma as ab  # noqa: E402
from omnicupy import BlockMask, masks, reference  # noqa: E402
from omnicupy.dispatch import plan as plan_mod  # noqa: E402
from omnicupy.dispatch.params import FORWARD_TMA  # noqa: E402
from omnicupy.ops import recall  # noqa: E402


@pytest.fixture
def h100_sms(monkeypatch):
    """Plan for 132 SMs (H100 SXM, H200) whatever GPU this machine has, if any."""
    monkeypatch.setattr(plan_mod, "sm_count", lambda: 132)


def dry_run_table(capsys, cases: str) -> dict[tuple[str, int, int, int], dict[str, str]]:
    """The dry run's printed table, by (mask, D, N, B)."""
    assert ab.main(["--dry-run", "--seed", "5", "--cases", cases]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "seed 5"
    header_at = next(i for i, line in enumerate(lines) if line.startswith("| kernel"))
    header = [c.strip() for c in lines[header_at].strip("|").split("|")]
    table = {}
    for line in lines[header_at + 2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        table[(cells["mask"], int(cells["D"]), int(cells["N"]), int(cells["B"]))] = cells
    return table


def test_dry_run_prints_grid_and_tile_lists(h100_sms, capsys):
    table = dry_run_table(capsys, "128:causal:8192:2,128:full:8192:2,128:document:8192:2,128:causal:1024:1")
    causal = table[("causal", 128, 8192, 2)]
    assert (causal["grid"], causal["tiles"], causal["lists"]) == ("132", "2048", "y")
    assert causal["kernel"].endswith("_tma_causal")
    full = table[("full", 128, 8192, 2)]
    assert (full["grid"], full["lists"]) == ("132", "n")  # equal tiles: grid stride is exact
    assert table[("document", 128, 8192, 2)]["lists"] == "y"
    small = table[("causal", 128, 1024, 1)]  # 8 q tiles x 16 heads: fewer tiles than SMs
    assert (small["grid"], small["tiles"], small["lists"]) == ("128", "128", "n")


def test_default_cases_are_the_nine_measured():
    cases = ab.parse_args(["--dry-run"]).cases
    assert len(cases) == 9 and cases[1] == ab.Case(128, "causal", 8192, 2)
    assert cases[-1] == ab.Case(128, "document", 8192, 2)


@pytest.mark.parametrize("text, message", [
    ("128:causal:8192", "expected HEAD_DIM:MASK:N:B"),
    ("128:sliding:8192:2", "unknown mask 'sliding'"),
    ("128:causal:8k:2", "N must be a positive integer"),
    ("0:full:1024:1", "HEAD_DIM must be a positive integer"),
    (",", "no cases"),
])
def test_case_parser_rejects_malformed_cases(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        ab.parse_cases(text)


def test_command_line_reports_a_malformed_case(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab.main(["--dry-run", "--cases", "128:full:8192:2,128:causal"])
    assert exit_info.value.code == 2
    assert "case '128:causal': expected HEAD_DIM:MASK:N:B" in capsys.readouterr().err


def test_document_lengths_follow_the_seed():
    a, b, c = (ab.document_lengths(8192, seed) for seed in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.sum() >= 8192 and a.min() >= ab.DOC_MIN and a.max() <= ab.DOC_MAX


class _NullKernel:
    name, function_ptr = "null", 0


def test_without_tile_lists_changes_only_grid_and_list_pointers(h100_sms):
    case = ab.Case(128, "causal", 8192, 2)
    bm = ab.build_mask(case, seed=0, xp=np)
    plan = plan_mod.plan_forward(head_dim=128, dtype="fp16", batch=2, heads=ab.HEADS, block_mask=bm, stages=None,
                                 bias=None, mask_expr=None, score_expr=None, arch="sm_90", family="tma")
    assert plan.cta_tiles is not None
    fields = {p.name: (i + 1 if p.count == 1 else []) for i, p in enumerate(FORWARD_TMA.params) if p.kind != "tmap"}
    fields.update({p.name: None for p in FORWARD_TMA.params if p.kind == "tmap"})
    recipe = recall.Recipe.make(_NullKernel(), plan, fields, FORWARD_TMA)
    tiles = ab.flat_tiles(plan, case)
    one = ab.without_tile_lists(recipe, (tiles, 1, 1))
    assert one.launcher.launches[0].grid == (tiles, 1, 1) and one.plan.cta_tiles is None
    assert recipe.launcher.launches[0].grid == plan.grid  # the original is left as it was
    before, after = FORWARD_TMA.unpack(recipe.template), FORWARD_TMA.unpack(one.template)
    assert before["cta_tiles"] and before["tile_list"] and after["cta_tiles"] == after["tile_list"] == 0
    assert {n: v for n, v in after.items() if n not in ("cta_tiles", "tile_list")} == \
        {n: v for n, v in before.items() if n not in ("cta_tiles", "tile_list")}


class _HostArray(np.ndarray):
    """A NumPy array with CuPy's ``get()``: the reference helpers read device arrays that way."""

    def get(self):
        return np.asarray(self)


def test_reference_rows_match_omnicupy_reference():
    n, d = 512, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, d)).view(_HostArray) for _ in range(3))
    ids = masks.doc_ids_from_lengths([200, 100, 212])
    bm = BlockMask.from_mask_mod(masks.document(ids), None, None, n, n, xp=np)
    rows = np.array([0, 150, 250, 511])
    got = ab.reference_rows(q, k, v, bm, rows)
    want = reference.attention(np.asarray(q), np.asarray(k), np.asarray(v), masks.document(ids))[0, 0][rows]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    out = np.zeros((1, 1, n, d), np.float16).view(_HostArray)
    out[0, 0, rows] = want
    max_abs, rel = ab.row_errors(out, want, rows)
    assert max_abs < 2e-3 and rel < 1e-3  # fp16 rounding only
    out[0, 0, 150, 0] = np.nan
    assert ab.row_errors(out, want, rows) == (float("inf"), float("inf"))
