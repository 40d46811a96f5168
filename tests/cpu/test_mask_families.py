"""The mask families (omnicupy/mask/families.py): each compiles, and the compiled mask equals the
evaluated mask_mod bit for bit at a few lengths (tails included); instances of one family at other
lengths (other closure values) share one CUDA expression key; a build through BlockMask equals the
dense mask."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask
from omnicupy.mask import families

LENGTHS = [200, 333, 1000]


@pytest.mark.parametrize("n", LENGTHS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_family_compiles_and_agrees(name, n):
    fn, q_len, kv_len = families.examples(n, [name])[name]
    compiled = omnicupy.compile_mask(fn)
    b, h = np.zeros((1, 1, 1, 1), np.int64), np.arange(2).reshape(1, -1, 1, 1)
    q, kv = np.arange(q_len).reshape(1, 1, -1, 1), np.arange(kv_len).reshape(1, 1, 1, -1)
    shape = (1, 2, q_len, kv_len)
    want = np.broadcast_to(fn(b, h, q, kv), shape)
    np.testing.assert_array_equal(np.broadcast_to(compiled(b, h, q, kv), shape), want)
    assert want.any() and not want.all()  # a mask that says something


@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_one_kernel_for_every_length(name):
    """Another length changes the closure's numbers and tables only: the same expression key."""
    keys = {omnicupy.compile_mask(families.examples(n, [name])[name][0]).cuda.key for n in (300, 700)}
    assert len(keys) == 1


@pytest.mark.parametrize("name", ["neighborhood_2d", "block_diffusion", "cross_attention", "packed_documents"])
def test_family_builds_its_dense_mask(name):
    fn, q_len, kv_len = families.examples(333, [name])[name]
    bm = BlockMask.from_mask_mod(fn, None, None, q_len, kv_len, q_block_size=64, kv_block_size=64, xp=np)
    q, kv = np.arange(q_len).reshape(-1, 1), np.arange(kv_len).reshape(1, -1)
    np.testing.assert_array_equal(bm.to_dense()[0, 0], np.broadcast_to(fn(0, 0, q, kv), (q_len, kv_len)))
    assert bm.mask_mod is fn


@pytest.mark.parametrize("make, message", [
    (lambda: families.neighborhood_2d(4, 4, 2), "does not fit"),
    (lambda: families.sliding_tile_2d(16, 16, 3, 3), "must divide"),
    (lambda: families.interleaved_text_image([("audio", 3)]), "segments"),
])
def test_family_arguments_refused(make, message):
    with pytest.raises(omnicupy.MaskError, match=message):
        make()
