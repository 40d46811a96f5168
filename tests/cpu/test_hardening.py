"""Issue 36, beyond the battery's table of bad inputs: a BlockMask that cannot change after
validation, the score derivative checked where it is rendered, built-in masks without int32 wraps,
the cache's file modes and what ``cache clear`` removes, environment switches refused everywhere,
and the short print of a distributed plan. CPU only, except where marked ``gpu``."""
from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, distributed, masks, score_mods
from omnicupy.errors import ArgumentError, ExpressionError, MaskError
from omnicupy.jit import env
from omnicupy.jit.cache import DiskCache
from omnicupy.mask.frozen import freeze, is_frozen

ARRAYS = ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices", "partial_block_masks")


def user_mask() -> BlockMask:
    nb = np.ones((1, 1, 1), np.int32)
    idx = np.zeros((1, 1, 1, 1), np.int32)
    types = np.full((1, 1, 1, 1), 3, np.int32)
    return BlockMask(nb, idx, types, q_len=128, kv_len=128, partial_block_mask_indices=idx,
                     partial_block_masks=np.zeros((1, 128, 4), np.uint32))


MASKS = [
    pytest.param(lambda: BlockMask.causal(512, 512), id="causal-builder"),
    pytest.param(lambda: BlockMask.full(300, 700), id="full-builder"),
    pytest.param(lambda: BlockMask.from_mask_mod(masks.sliding_window(100), 2, 3, 512, 512), id="mask-mod"),
    pytest.param(lambda: BlockMask.from_dense(np.tril(np.ones((256, 256), bool))[None, None]), id="dense"),
    pytest.param(user_mask, id="constructor"),
]


@pytest.mark.parametrize("make", MASKS)
def test_public_arrays_can_never_be_made_writable(make):
    """The issue's first way: ``b.kv_indices.flags.writeable = True`` then a write."""
    bm = make()
    for name in ARRAYS + ("q_block_work",):
        a = getattr(bm, name)
        if a is None:
            continue
        assert is_frozen(a), name
        with pytest.raises(ValueError, match="WRITEABLE"):
            a.flags.writeable = True
        base = a
        while isinstance(base.base, np.ndarray):  # nor through any array it views
            base = base.base
            with pytest.raises(ValueError, match="WRITEABLE"):
                base.flags.writeable = True
        assert isinstance(base.base, bytes)  # the memory is an immutable bytes object


@pytest.mark.parametrize("make", MASKS)
def test_attributes_cannot_be_reassigned(make):
    """The issue's second way: ``b.kv_indices = np.full(..., -7)``."""
    bm = make()
    for name in ARRAYS + ("q_len", "kv_len", "mask_mod", "features", "summary"):
        with pytest.raises(MaskError, match="cannot be changed"):
            setattr(bm, name, np.full((1, 1, 1, 1), -7, np.int32))


def test_a_swap_behind_the_seal_is_caught_at_upload():
    """The cached device metadata path: device_metadata() checks the validated arrays are still held
    before it uploads (or returns its cached copies), so a bypass of __setattr__ is refused."""
    bm = BlockMask.causal(512, 512)
    object.__setattr__(bm, "_kv_indices", np.full(bm.kv_indices.shape, 10**6, np.int32))
    with pytest.raises(MaskError, match="replaced after validation"):
        bm.device_metadata()


def test_callers_arrays_stay_theirs():
    nb, idx, types = np.ones((1, 1, 1), np.int32), np.zeros((1, 1, 1, 1), np.int32), np.full((1, 1, 1, 1), 2, np.int32)
    bm = BlockMask(nb, idx, types, q_len=128, kv_len=128)
    idx[...] = 10**6
    assert int(bm.kv_indices[0, 0, 0, 0]) == 0
    assert idx.flags.writeable  # the caller's array is not frozen


@pytest.mark.parametrize("a", [
    pytest.param(np.arange(12, dtype=np.int32).reshape(3, 4), id="contiguous"),
    pytest.param(np.broadcast_to(np.arange(4, dtype=np.int32), (1000, 4)), id="broadcast"),
    pytest.param(np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::-2], id="reversed-strided"),
    pytest.param(np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)), id="fortran"),
])
def test_freeze_keeps_values_shape_and_compactness(a):
    f = freeze(a)
    np.testing.assert_array_equal(f, a)
    assert f.strides == a.strides and is_frozen(f)
    assert freeze(f) is f
    with pytest.raises(ValueError):
        f.flags.writeable = True


@pytest.mark.gpu
def test_device_mask_hands_out_copies():
    import cupy as cp

    bm = BlockMask.causal(512, 512)
    dev = BlockMask(*(cp.asarray(getattr(bm, n)) for n in ARRAYS[:3]), q_len=512, kv_len=512)
    dev.kv_indices[...] = 10**6  # a copy: the mask's own device arrays are untouched
    assert int(dev.kv_indices.max()) < 4
    assert int(dev.device_metadata().kv_indices.max()) < 4


# ------------------------------------------------------------------ derivative checked where rendered
@pytest.mark.parametrize("grad", ['1.0f); }\nextern "C" __global__ void injected(int* p) { *p = 1; } '
                                  'static float x = (1.0f', "1.0f;", "score = 1.0f"])
def test_score_derivative_is_checked_where_it_is_rendered(grad):
    q = np.zeros((1, 2, 128, 64), np.float16)
    plan = omnicupy.ops.backward.plan(q, q, q, causal=True, score_mod=score_mods.softcap(30.0), arch="sm_80")
    assert plan.variant.template_params()["score_grad"] == plan.variant.score_grad  # the valid one renders
    forged = dataclasses.replace(plan.variant, score_grad=grad)  # as if made by hand, past every entry check
    with pytest.raises(ExpressionError):
        forged.template_params()


# ------------------------------------------------------------------ built-in masks: no int32 wrap
@pytest.mark.parametrize("mod,forbidden", [
    pytest.param(masks.local_window(0, 2**31 - 1), "q_idx +", id="local-window-right"),
    pytest.param(masks.local_window(2**31 - 1, 0), "q_idx - 2147483647", id="local-window-left"),
    pytest.param(masks.causal(2**31 - 1), "q_idx +", id="causal-offset"),
])
def test_built_in_expressions_compare_differences(mod, forbidden):
    assert forbidden not in mod.cuda_expr
    # the NumPy form at the extremes of int32 positions agrees with the rule
    q = np.array([0, 2**31 - 2**16 - 1], np.int32)[:, None]
    kv = np.array([0, 2**31 - 2**16 - 1], np.int32)[None, :]
    got = np.asarray(mod(0, 0, q, kv))
    assert got.dtype == bool and got.shape == (2, 2)


def test_local_window_at_the_int32_limit_allows_every_later_key():
    mod = masks.local_window(0, 2**31 - 1)
    q, kv = np.arange(8)[:, None], np.arange(8)[None, :]
    np.testing.assert_array_equal(mod(0, 0, q, kv), kv >= q)


# ------------------------------------------------------------------ cache: modes and what is removed
STEM = "kernel_a-sm_80-0123456789abcdef"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX modes")
@pytest.mark.parametrize("suffix", [".cubin", ".json"])
@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_entry_file_writable_by_others_is_never_loaded(tmp_path, suffix, mode):
    cache = DiskCache(tmp_path / "cache")
    cache.store(STEM, b"abc", {"kernel": "k"})
    os.chmod(cache.dir / f"{STEM}{suffix}", mode)
    assert cache.load(STEM) is None


def test_clear_and_list_leave_files_omnicupy_did_not_write(tmp_path):
    cache = DiskCache(tmp_path / "cache")
    cache.store(STEM, b"abc", {"kernel": "k"})
    mine = {"notes.json": b'{"a": 1}', "other-sm_80-0123456789abcdef.json": b"[1, 2]", "data.cubin": b"\0"}
    for name, data in mine.items():
        (cache.dir / name).write_bytes(data)
        os.chmod(cache.dir / name, 0o600)
    assert [e.stem for e in cache.entries()] == [STEM]
    assert cache.clear() == 1
    assert sorted(os.listdir(cache.dir)) == sorted(["CACHEDIR.TAG", "locks", *mine])
    for name, data in mine.items():
        assert (cache.dir / name).read_bytes() == data


def test_cli_refuses_an_empty_cache_dir(capsys):
    from omnicupy.cli.main import main

    assert main(["--cache-dir", "", "cache", "path"]) == 2
    assert "--cache-dir is empty" in capsys.readouterr().err


# ------------------------------------------------------------------ environment switches everywhere
@pytest.mark.parametrize("name,value", [("OMNICUPY_KEEP_SOURCE", "maybe"), ("OMNICUPY_MMA", "bogus"),
                                        ("OMNICUPY_BWD", "fast"), ("OMNICUPY_SCHEDULE", "random"),
                                        ("OMNICUPY_LINEINFO", "2"), ("OMNICUPY_VERBOSE", "sure"),
                                        ("OMNICUPY_CACHE_DIR", " ")])
def test_bad_switch_is_refused_wherever_kernels_are_built(monkeypatch, tmp_path, name, value):
    from omnicupy.jit import build

    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=name):
        env.check_all()

    class NeverRendered:  # build() refuses before rendering anything
        name = "x"

        def target_arch(self, arch):
            raise AssertionError("reached past the environment check")

    with pytest.raises(ArgumentError, match=name):
        build(NeverRendered(), "sm_80", DiskCache(tmp_path))


# ------------------------------------------------------------------ distributed plan summary
@pytest.mark.parametrize("world", [2, 64])
def test_print_of_a_distributed_plan_is_short(world):
    n = 128 * world * 2
    plan = distributed.plan(BlockMask.causal(n, n), world)
    for text, most_lines in ((repr(plan), 1), (str(plan), 1), (plan.summary(), 12)):
        assert len(text.splitlines()) <= most_lines and len(text) < 2000 and "array(" not in text
