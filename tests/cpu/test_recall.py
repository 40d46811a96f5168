"""Steady-state bookkeeping that needs no GPU: the output-overlap test of ops/recall.py and the
mask a cached call keeps its recipe on (the backward's workspace layout: test_backward_host.py)."""
from __future__ import annotations

import numpy as np
import pytest

from omnicupy.ops import recall

F16 = np.dtype(np.float16)


def _view(ptr, shape, dtype=F16, strides=None):
    strides = strides or tuple(np.empty(shape, dtype).strides) if 0 not in shape else (0,) * len(shape)
    return ptr, shape, strides, np.dtype(dtype), 0


@pytest.mark.parametrize("out, others, expected", [
    pytest.param(_view(0x10000, (1, 2, 8, 64)), [_view(0x10000, (1, 2, 8, 64))], True, id="same-buffer"),
    pytest.param(_view(0x10000, (1, 2, 8, 64)), [_view(0x10000 + 2048, (1, 2, 8, 64))], False, id="adjacent-after"),
    pytest.param(_view(0x10000 + 2048, (1, 2, 8, 64)), [_view(0x10000, (1, 2, 8, 64))], False, id="adjacent-before"),
    pytest.param(_view(0x10000 + 2046, (1, 2, 8, 64)), [_view(0x10000, (1, 2, 8, 64))], True, id="last-element"),
    pytest.param(_view(0x10000, (1, 1, 8, 64), strides=(4096, 4096, 256, 2)), [_view(0x10080, (1, 1, 8, 64),
                 strides=(4096, 4096, 256, 2))], True, id="interleaved-rows-span"),  # conservative: spans overlap
    pytest.param(_view(0x20000, (1, 2, 8, 64)), [_view(0x10000, (1, 2, 8, 64)), _view(0x20400, (1, 1, 1, 64))], True,
                 id="second-input"),
    pytest.param(_view(0x20000, (1, 2, 0, 64)), [_view(0x20000, (1, 2, 8, 64))], False, id="empty-out"),
    pytest.param(_view(0x20000 + 4 * 1024, (2, 2, 8, 64), strides=(-4096, 2048, 128, 2)),
                 [_view(0x20000, (1, 1, 1, 64))], True, id="negative-stride"),
])
def test_overlaps(out, others, expected):
    assert recall.overlaps(out, others) is expected


@pytest.mark.parametrize("block_mask, causal, q_len, kv_len, expected", [
    pytest.param("given", False, 300, 300, "given", id="callers-mask"),
    pytest.param(None, False, 300, 400, "full", id="no-mask-full"),
    pytest.param(None, True, 300, 300, "top_left", id="causal-true"),
    pytest.param(None, "bottom_right", 100, 300, "bottom_right", id="bottom-right"),
    pytest.param(None, "sideways", 300, 300, None, id="bad-causal-general-path"),
    pytest.param(None, [True], 300, 300, None, id="unhashable-causal"),
    pytest.param("not a mask", False, 300, 300, None, id="other-type"),
])
def test_steady_mask(block_mask, causal, q_len, kv_len, expected):
    """The mask a cached forward/backward call keeps its recipe on, or None (then the general path
    runs and names the problem)."""
    from omnicupy import BlockMask
    from omnicupy.ops.forward import steady_mask

    given = BlockMask.causal(q_len, kv_len) if block_mask == "given" else block_mask
    got = steady_mask(given, causal, q_len, kv_len)
    if expected is None:
        assert got is None
    elif expected == "given":
        assert got is given
    else:
        i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        want = {"full": np.ones((q_len, kv_len), bool), "top_left": i >= j,
                "bottom_right": i + (kv_len - q_len) >= j}[expected]
        assert isinstance(got, BlockMask) and np.array_equal(np.asarray(got.to_dense()).reshape(q_len, kv_len), want)
        assert steady_mask(None, causal, q_len, kv_len) is got  # built once per (mode, sizes)


# ------------------------------------------------------------------ the forward's steady-state key
class _FakeArray:
    """What recall.view reads of a CuPy array (no GPU here)."""

    def __init__(self, ptr, shape=(1, 2, 16, 64), dtype=F16):
        self.data = type("Ptr", (), {"ptr": ptr, "device_id": 0})()
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.strides = tuple(np.empty(shape, dtype).strides)


_FAKE_CP = type("FakeCupy", (), {"ndarray": _FakeArray})
_DEFAULTS = dict(causal=True, scale=None, return_lse=False, stages=None, out=None, bias=None, score_mod=None,
                 fuse_mask=False, kv_lens=None, num_splits=None)


def _forward_key(ptr=0x1000, shape=(1, 2, 16, 64), **options):
    from omnicupy.ops.forward import _steady_key

    args = dict(_DEFAULTS, **options)
    q = _FakeArray(ptr, shape)
    return _steady_key(q, _FakeArray(ptr + 0x10000, shape), _FakeArray(ptr + 0x20000, shape), args["out"],
                       args["kv_lens"], None, args["causal"], args["scale"], args["bias"], args["score_mod"],
                       args["return_lse"], args["stages"], args["fuse_mask"], args["num_splits"], _FAKE_CP)[0]


@pytest.mark.parametrize("first, second, same", [
    pytest.param({}, {"ptr": 0x9000}, True, id="new-pointers-same-key"),
    pytest.param({}, {"shape": (1, 2, 32, 64)}, False, id="new-length"),
    pytest.param({}, {"causal": False}, False, id="causal-off"),
    pytest.param({}, {"causal": 1}, False, id="causal-1-is-not-True"),
    pytest.param({}, {"causal": "bottom_right"}, False, id="bottom-right"),
    pytest.param({}, {"scale": 0.125}, False, id="scale-given"),
    pytest.param({"scale": 2}, {"scale": 2.0}, False, id="scale-int-vs-float"),
    pytest.param({}, {"return_lse": True}, False, id="return-lse"),
    pytest.param({"return_lse": True}, {"return_lse": 1}, False, id="return-lse-1-is-not-True"),
    pytest.param({}, {"return_lse": 0}, False, id="return-lse-0-takes-the-long-key"),
    pytest.param({}, {"stages": 2}, False, id="stages"),
    pytest.param({}, {"fuse_mask": True}, False, id="fuse-mask"),
    pytest.param({}, {"num_splits": 4}, False, id="num-splits"),
    pytest.param({}, {"out": _FakeArray(0x80000)}, False, id="out-given"),
    pytest.param({"out": _FakeArray(0x80000)}, {"out": _FakeArray(0x90000)}, True, id="out-new-pointer"),
    pytest.param({"out": _FakeArray(0x80000)}, {"out": _FakeArray(0x80000, shape=(1, 2, 32, 64))}, False,
                 id="out-new-layout"),
])
def test_forward_steady_key(first, second, same):
    """Calls share a recipe exactly when nothing but their data pointers differ; the defaults' short
    key (no options) never equals a key with options."""
    a, b = _forward_key(**first), _forward_key(**second)
    assert a is not None and b is not None
    assert (a == b) is same


def test_forward_steady_key_refuses_what_the_general_path_must_check():
    assert _forward_key(out=np.zeros((1, 2, 16, 64), F16)) is None  # a NumPy out: the general path returns CuPy
    assert _forward_key(shape=(2, 16, 64)) is None  # not 4-D: the general path says what is wrong


# ------------------------------------------------------------------------- decode steady-state keys
class _DeviceArray:
    """What recall.view reads of a CuPy array (pointer, shape, strides, dtype, device)."""

    def __init__(self, ptr, shape, dtype=F16):
        self.data = type("D", (), {"ptr": ptr, "device_id": 0})()
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.strides = np.empty(shape, self.dtype).strides


_CP = type("FakeCupy", (), {"ndarray": _DeviceArray})


def _attention_key():
    from omnicupy.ops import forward

    q, k, v = (_DeviceArray(0x10000 * i, shape) for i, shape in ((1, (2, 32, 1, 128)), (2, (2, 8, 4096, 128)),
                                                                 (3, (2, 8, 4096, 128))))
    lens = _DeviceArray(0x40000, (2,), np.int32)
    key, mask, *_ = forward._steady_key(q, k, v, None, lens, None, True, None, None, None, False, None, False, None,
                                        _CP)
    assert mask is not None
    return key


def _paged_key():
    from omnicupy.ops import paged

    arrays_in = (_DeviceArray(0x10000, (2, 32, 1, 128)), _DeviceArray(0x20000, (64, 16, 8, 128)),
                 _DeviceArray(0x30000, (64, 16, 8, 128)), _DeviceArray(0x40000, (2, 32), np.int32),
                 _DeviceArray(0x50000, (2,), np.int32))
    key, _ = paged._steady_key(arrays_in, None, (True, None, None, 0, False, "NHD", None, True), _CP)
    return key


def _tunables():
    from omnicupy.ops import decode

    return [("FUSED_COMBINE", not decode.FUSED_COMBINE), ("DECODE_MAX_ROWS", 16),
            ("DECODE_TILES", decode.DECODE_TILES.updated({(128, 16): (2, 3)})), ("MIN_TILES_PER_GROUP", 4),
            ("MAX_SPLITS", 64), ("WAVE_TOLERANCE", 0.9), ("RAGGED_WAVES", 2), ("RAGGED_MIN_KEYS", 4096),
            ("COMBINE_WARPS", 8)]


@pytest.mark.parametrize("make_key", [pytest.param(_attention_key, id="attention"),
                                      pytest.param(_paged_key, id="paged")])
@pytest.mark.parametrize("name,value", [pytest.param(n, v, id=n) for n, v in _tunables()])
def test_decode_steady_key_follows_the_tunables(monkeypatch, make_key, name, value):
    """A decode tunable changed between two calls (ops/decode.settings(): what the plan depends on
    beside the call) must not replay the recipe planned under the old value: the key changes, and
    comes back when the value does."""
    from omnicupy.ops import decode

    first = make_key()
    assert make_key() == first  # same call, same tunables: the recipe is found
    old = getattr(decode, name)
    monkeypatch.setattr(decode, name, value)
    assert make_key() != first
    monkeypatch.setattr(decode, name, old)
    assert make_key() == first


# ------------------------------------------------------------------------------------ recipe stores
@pytest.mark.parametrize("limit,puts,want", [
    pytest.param(3, ["a", "b", "c"], ["a", "b", "c"], id="up-to-the-limit"),
    pytest.param(3, ["a", "b", "c", "a"], ["a", "b", "c"], id="known-key-replaced-in-place"),
    pytest.param(3, ["a", "b", "c", "d"], ["d"], id="full-cleared-for-a-new-key"),
    pytest.param(3, ["a", "b", "c", "d", "e", "f", "g"], ["g"], id="cleared-again"),
    pytest.param(2, ["a", ["unhashable"], "b"], ["a", "b"], id="unhashable-never-stored"),
])
def test_recipe_store_is_bounded(limit, puts, want):
    store = recall.RecipeStore(limit)
    for i, key in enumerate(puts):
        store.put(key, i)
        assert len(store) <= limit
    assert list(store) == want
    assert [store.get(k) for k in want] == [len(puts) - 1 - puts[::-1].index(k) for k in want]
    assert store.get(["unhashable"]) is None and ["unhashable"] not in store


def test_masks_and_paged_share_one_bounded_store():
    """A BlockMask gets its RecipeStore with its first recipe; paged_attention keeps one of the same
    kind; both hold at most MAX_RECIPES."""
    from omnicupy import BlockMask
    from omnicupy.ops import paged

    bm = BlockMask.causal(256, 256)
    assert recall.recipe_for(bm, ("k", 0)) is None
    recipe = recall.ChainRecipe(steps=(), scratch=(), scratch_bytes=0, keep=())
    for i in range(recall.MAX_RECIPES + 1):
        recall.remember(bm, ("k", i), recipe, "alive")
    store = recall.store_of(bm)
    assert type(store) is type(paged._recipes) is recall.RecipeStore
    assert store.limit == paged._recipes.limit == recall.MAX_RECIPES
    assert len(store) == 1 and recall.recipe_for(bm, ("k", recall.MAX_RECIPES)).keep == ("alive",)
