"""CPU tests of lab/bench/masked_tiles.py: the typed masks are the element masks they claim to be,
with the block types asked for. No GPU needed."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lab.bench import masked_tiles as mt  # noqa: E402

# (lower, diagonal, upper) -> the element mask (full or causal) and the block-type counts
# (masked, causal, full, partial) at nb blocks per side
TYPED = [
    pytest.param((mt.FULL, mt.FULL, mt.FULL), "full", lambda nb: (0, 0, nb * nb, 0), id="full-FULL"),
    pytest.param((mt.PARTIAL, mt.PARTIAL, mt.PARTIAL), "full", lambda nb: (0, 0, 0, nb * nb), id="full-PARTIAL"),
    pytest.param((mt.FULL, mt.CAUSAL, None), "causal", lambda nb: (nb * (nb - 1) // 2, nb, nb * (nb - 1) // 2, 0),
                 id="causal-FULL"),
    pytest.param((mt.PARTIAL, mt.CAUSAL, None), "causal",
                 lambda nb: (nb * (nb - 1) // 2, nb, 0, nb * (nb - 1) // 2), id="causal-PARTIAL"),
]


@pytest.mark.parametrize("n", [128, 333, 1024])
@pytest.mark.parametrize("types,element,counts", TYPED)
def test_typed_masks_are_the_element_mask_with_the_types_asked_for(n, types, element, counts):
    bm = mt.typed_mask(n, *types)
    dense = bm.to_dense()[0, 0]
    want = np.ones((n, n), bool) if element == "full" else np.tril(np.ones((n, n), bool))
    np.testing.assert_array_equal(dense, want)
    nb = -(-n // mt.BLOCK)
    assert bm.summary.counts == counts(nb)
    assert mt.listed_blocks(bm) == sum(counts(nb)[1:])


def test_cases_and_dry_run(capsys):
    cases = mt.cases_at(1024, [128, 1024], np)
    assert len(cases) == 6 and all(c.q_len == 1024 for c in cases.values())
    assert mt.main(["--dry-run", "--n", "1024", "--windows", "128,1024"]) == 0
    out = capsys.readouterr().out
    assert "full, PARTIAL blocks" in out and "sliding window 1024" in out
