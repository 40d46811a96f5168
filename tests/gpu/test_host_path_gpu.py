"""The steady-state call path: cached launches give the same results as first calls, attention()
never synchronizes the host with the device, and it can be captured in a CUDA graph and replayed
(issue: the host path). Every random input is seeded; the seed is in each assertion message."""
from __future__ import annotations

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, masks, reference
from omnicupy.ops import recall

from helpers import TOLERANCE

pytestmark = pytest.mark.gpu

SEED = 20261123


def _inputs(cp, seed, B=2, H=4, N=777, D=128, dtype="fp16"):
    rng = cp.random.default_rng(seed)
    dt = cp.float16 if dtype == "fp16" else omnicupy.arrays.BFLOAT16
    return [rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(dt) for _ in range(3)]


def _gpu_mask(cp, n):
    """A mask built on the GPU (CuPy metadata), never used by a kernel yet."""
    segments = [("text", 100), ("image", 200), ("text", n - 300)]
    return BlockMask.from_mask_mod(masks.interleaved(segments), None, None, n, n, xp=cp) \
        if "xp" in BlockMask.from_mask_mod.__code__.co_varnames else \
        BlockMask.from_mask_mod(masks.interleaved(segments), None, None, n, n)


@pytest.mark.parametrize("kind", ["causal", "gpu_mask", "bias"])
def test_cached_calls_match_first_call(kind):
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    kwargs = {"causal": True} if kind == "causal" else {}
    if kind == "gpu_mask":
        kwargs["block_mask"] = _gpu_mask(cp, q.shape[2])
    if kind == "bias":
        kwargs["bias"] = cp.asarray(np.random.default_rng(SEED).standard_normal((1, 4, 777)).astype(np.float32))
    first = omnicupy.attention(q, k, v, **kwargs)
    for i in range(3):  # steady state: the recipe path, fresh data each time
        q2, k2, v2 = _inputs(cp, SEED + 1 + i)
        cached = omnicupy.attention(q2, k2, v2, **kwargs)
        fresh = omnicupy.attention(q2.copy(), k2.copy(), v2.copy(), **kwargs)  # other pointers, same recipe
        assert cp.array_equal(cached, fresh), f"seed {SEED + 1 + i}"
    again = omnicupy.attention(q, k, v, **kwargs)
    assert cp.array_equal(first, again), f"seed {SEED}"
    mask = kwargs.get("block_mask")
    mask_fn = masks.causal() if kind == "causal" else (mask.mask_mod if mask is not None else None)
    bias = None if kind != "bias" else kwargs["bias"].get()
    ref = reference.attention(q[:1].get(), k[:1].get(), v[:1].get(), mask_fn, bias=None if bias is None else bias)
    err = reference.relative_error(again[:1], ref)
    assert err <= TOLERANCE["fp16"], f"seed {SEED}: error {err}"


def test_attention_does_not_synchronize():
    cp = pytest.importorskip("cupy")
    cupyx = pytest.importorskip("cupyx")
    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2])
    # First call of a mask built on the GPU, and steady-state calls: no implicit synchronization.
    with cupyx.allow_synchronize(False):
        for _ in range(2):
            omnicupy.attention(q, k, v, bm)
            omnicupy.attention(q, k, v, causal=True, return_lse=True)
            omnicupy.attention(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("mask_kind", ["gpu_mask_unused", "causal"])
def test_graph_capture_and_replay(mask_kind):
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2]) if mask_kind == "gpu_mask_unused" else None
    kwargs = {"causal": True} if bm is None else {}
    out = cp.empty_like(q)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        omnicupy.attention(q, k, v, bm, out=out, **kwargs)
        graph = stream.end_capture()
    with stream:  # everything on the replay's stream: no race between the copies and the graph
        expected = omnicupy.attention(q, k, v, bm, **kwargs)
        out.fill(float("nan"))
        graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, expected), f"seed {SEED}"
    q2, k2, v2 = _inputs(cp, SEED + 7)  # replay reads whatever the captured buffers hold now
    cp.cuda.Device().synchronize()
    with stream:
        q[...], k[...], v[...] = q2, k2, v2
        graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, omnicupy.attention(q2, k2, v2, bm, **kwargs)), f"seed {SEED + 7}"


# ------------------------------------------------------------------ backward, launch routes, threads (issue 13)
BWD_TOLERANCE = TOLERANCE["fp16"]  # as tests/gpu/test_backward_gpu.py: relative Frobenius error vs float64


def _clear_recipes(bm):
    recall.store_of(bm).clear()


def _mask_of(cp, kind, n):
    if kind == "causal":
        return None, {"causal": True}, masks.causal()
    bm = _gpu_mask(cp, n)
    return bm, {}, bm.mask_mod


@pytest.mark.parametrize("kind, deterministic", [
    pytest.param("causal", False, id="causal"),
    pytest.param("gpu_mask", False, id="gpu_mask"),
    pytest.param("gpu_mask", True, id="gpu_mask-deterministic"),
    pytest.param("causal", True, id="causal-deterministic"),
])
def test_backward_cached_calls_match_first_calls(kind, deterministic):
    cp = pytest.importorskip("cupy")
    from omnicupy.ops import forward

    q, k, v = _inputs(cp, SEED, H=2)
    bm, kwargs, mask_fn = _mask_of(cp, kind, q.shape[2])
    owner = bm if bm is not None else forward._builtin_mask("top_left", q.shape[2], k.shape[2])
    for i in range(3):
        seed = SEED + 10 + i
        q, k, v, do = _inputs(cp, seed, H=2) + _inputs(cp, seed + 100, H=2)[:1]
        out, lse = omnicupy.attention(q, k, v, bm, return_lse=True, **kwargs)
        cached = omnicupy.attention_backward(do, q, k, v, out, lse, bm, deterministic=deterministic, **kwargs)
        assert any(key[0] == "backward" for key in owner._recipes if isinstance(key, tuple)), "no backward recipe"
        _clear_recipes(owner)  # the general path again, on the same data
        general = omnicupy.attention_backward(do, q, k, v, out, lse, bm, deterministic=deterministic, **kwargs)
        for name, a, b in zip(("dq", "dk", "dv"), cached, general):
            if deterministic:
                assert cp.array_equal(a, b), f"seed {seed}: {name} differs between the recipe and the general path"
            else:
                assert cp.allclose(a, b, rtol=1e-2, atol=2e-3), f"seed {seed}: {name}"
        ref = reference.attention_backward(do[:1].get(), q[:1].get(), k[:1].get(), v[:1].get(), mask_fn)
        for name, got, want in zip(("dq", "dk", "dv"), cached, ref):
            err = reference.relative_error(got[:1], want)
            assert err <= BWD_TOLERANCE, f"seed {seed}: {name} error {err:.2e}"


def _spin(cp, seconds=2.0):
    """Occupy the current stream for about ``seconds`` (one thread spinning on clock64)."""
    kernel = cp.RawKernel(r'''
extern "C" __global__ void omni_test_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}''', "omni_test_spin")
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    rate_khz = props.get("clockRate") or 2_000_000  # SM clock in kHz (a guess of 2 GHz where not reported)
    kernel((1,), (1,), (np.int64(seconds * rate_khz * 1e3),))


def test_calls_return_while_the_device_is_busy():
    """A call that synchronized with the device would wait for the spinning kernel ahead of it."""
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    do = _inputs(cp, SEED + 1)[0]
    warm = _gpu_mask(cp, q.shape[2])  # compiles and loads every kernel the timed calls use
    out, lse = omnicupy.attention(q, k, v, warm, return_lse=True)
    omnicupy.attention_backward(do, q, k, v, out, lse, warm)
    omnicupy.attention(q, k, v, causal=True)
    cp.cuda.Device().synchronize()
    fresh = _gpu_mask(cp, q.shape[2])  # built on the GPU, never used by a kernel yet
    cp.cuda.Device().synchronize()
    _spin(cp)
    busy = cp.cuda.Event()
    busy.record()
    calls = [
        ("first forward call on a new GPU mask", lambda: omnicupy.attention(q, k, v, fresh, return_lse=True)),
        ("steady-state forward", lambda: omnicupy.attention(q, k, v, fresh, return_lse=True)),
        ("steady-state causal forward", lambda: omnicupy.attention(q, k, v, causal=True)),
        ("first backward call on the new mask", lambda: omnicupy.attention_backward(do, q, k, v, out, lse, fresh)),
        ("steady-state backward", lambda: omnicupy.attention_backward(do, q, k, v, out, lse, fresh)),
    ]
    for label, call in calls:
        call()
        assert not busy.done, f"{label}: returned only after the device finished earlier work (a synchronization)"
    cp.cuda.Device().synchronize()


@pytest.mark.parametrize("captured_first", [pytest.param(False, id="warm"),
                                            pytest.param(True, id="first-call-captured")])
def test_backward_graph_capture_and_replay(captured_first):
    cp = pytest.importorskip("cupy")
    from omnicupy.ops import backward as backward_op

    q, k, v = _inputs(cp, SEED, H=2)
    do = _inputs(cp, SEED + 3, H=2)[0]
    bm = _gpu_mask(cp, q.shape[2])
    out, lse = omnicupy.attention(q, k, v, bm, return_lse=True)
    grads = [cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)]

    def call():
        omnicupy.attention_backward(do, q, k, v, out, lse, bm, deterministic=True, dq=grads[0], dk=grads[1],
                                    dv=grads[2])

    if not captured_first:
        call()
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    try:
        with stream:
            expected = omnicupy.attention_backward(do, q, k, v, out, lse, bm, deterministic=True)
            for g in grads:
                g.fill(float("nan"))
            graph.launch(stream)
            graph.launch(stream)  # twice: the workspace (turn counters, accumulator) is reset by the graph itself
        stream.synchronize()
        for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
            assert cp.array_equal(got, want), f"seed {SEED}: {name} of the replayed graph"
    finally:
        backward_op.release_captured()


def test_launch_routes_give_identical_results():
    cp = pytest.importorskip("cupy")
    from omnicupy.jit import launch

    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2])
    results = {}
    try:
        for name in launch.available_routes():
            launch.use_route(name)
            first = omnicupy.attention(q, k, v, bm)
            results[name] = (first, omnicupy.attention(q, k, v, bm))  # first: recipe made; second: recipe used
    finally:
        launch.use_route(None)
    assert "driver" in results, f"CuPy's driver wrapper is missing: routes {list(results)}"
    base = results["driver"][0]
    for name, (first, second) in results.items():
        assert cp.array_equal(first, base) and cp.array_equal(second, base), f"seed {SEED}: route {name}"


@pytest.mark.parametrize("route_name", ["driver", "bindings", "function"])
def test_refused_launch_is_a_launch_error(route_name):
    cp = pytest.importorskip("cupy")
    from omnicupy.jit import launch

    if route_name not in launch.available_routes():
        pytest.skip(f"route {route_name} not available here")
    q, k, v = _inputs(cp, SEED)
    bm = _gpu_mask(cp, q.shape[2])
    omnicupy.attention(q, k, v, bm)
    recipe = next(iter(bm._recipes.values()))
    item = recipe.launcher.launches[0]
    bad = launch.Launcher(recipe.template, [launch.KernelLaunch(item.kernel, item.grid, (4096, 1, 1),
                                                                item.shared_mem)])
    try:
        launch.use_route(route_name)
        with pytest.raises(launch.LaunchError, match="block \\(4096, 1, 1\\)"):
            bad.launch()
    finally:
        launch.use_route(None)
    again = omnicupy.attention(q, k, v, bm)  # the context survived the refused launch
    assert cp.array_equal(again, omnicupy.attention(q.copy(), k.copy(), v.copy(), bm)), f"seed {SEED}"


def test_threads_sharing_a_recipe_get_their_own_results():
    cp = pytest.importorskip("cupy")
    import threading

    bm = _gpu_mask(cp, 777)
    seeds = [SEED + 20 + i for i in range(4)]
    inputs = {s: _inputs(cp, s) for s in seeds}
    expected = {s: omnicupy.attention(*inputs[s], bm) for s in seeds}
    cp.cuda.Device().synchronize()
    got, errors = {s: [] for s in seeds}, []

    def worker(seed):
        try:
            cp.cuda.Device(0).use()
            with cp.cuda.Stream(non_blocking=True) as stream:
                for _ in range(25):
                    got[seed].append(omnicupy.attention(*inputs[seed], bm))
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in seeds:
        assert all(cp.array_equal(o, expected[s]) for o in got[s]), f"seed {s}: a thread got another's pointers"


def test_steady_state_out_that_aliases_an_input_is_refused():
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs(cp, SEED)
    out = cp.empty_like(q)
    omnicupy.attention(q, k, v, causal=True, out=out)  # the recipe for this signature
    omnicupy.attention(q, k, v, causal=True, out=out)
    with pytest.raises(omnicupy.errors.AliasError):
        omnicupy.attention(q, k, v, causal=True, out=q)  # same layout as `out`: only the pointers differ


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_torch_inputs_take_the_same_kernel(dtype):
    cp = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    tdtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    tq, tk, tv = (torch.randn((2, 4, 777, 128), generator=gen, device="cuda").to(tdtype) for _ in range(3))
    torch.cuda.synchronize()
    want = omnicupy.attention(*(cp.from_dlpack(t) for t in (tq, tk, tv)), causal=True)
    for _ in range(2):  # first call, then the recipe (tensors read by attribute)
        assert cp.array_equal(omnicupy.attention(tq, tk, tv, causal=True), want), f"seed {SEED} {dtype}"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # torch's current stream is not CuPy's: the general path orders them
        got = omnicupy.attention(tq, tk, tv, causal=True)
    cp.cuda.Device().synchronize()
    assert cp.array_equal(got, want), f"seed {SEED} {dtype} (torch side stream)"
    from omnicupy.ops import recall

    needs_grad = tq.detach().clone().requires_grad_()
    assert recall.view(needs_grad, cp) is None  # the general path decides about it, as on a first call
    with torch.cuda.stream(side):
        assert recall.view(tq, cp) is None  # another current stream: the general path orders the streams


# ------------------------------------------------------------------ decode-shaped calls (split-KV kernel)
def _decode_inputs(cp, seed, B=3, Hq=8, Hkv=2, Nq=2, Nkv=1000, D=128):
    rng = cp.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D), dtype=cp.float32).astype(cp.float16)
    k, v = (rng.standard_normal((B, Hkv, Nkv, D), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    return q, k, v


DECODE_CASES = [
    pytest.param({"causal": "bottom_right"}, False, id="bottom-right"),
    pytest.param({"causal": True}, True, id="device-kv-lens"),
    pytest.param({"causal": True, "num_splits": 4}, True, id="device-kv-lens-4-splits"),
    pytest.param({"num_splits": 1, "return_lse": True}, True, id="one-split-lse"),
    pytest.param({"causal": True, "return_lse": True}, True, id="device-kv-lens-lse"),
]


@pytest.mark.parametrize("kwargs, with_lens", DECODE_CASES)
def test_decode_cached_calls_match_first_calls(kwargs, with_lens):
    cp = pytest.importorskip("cupy")
    from omnicupy.ops import forward, recall

    q, k, v = _decode_inputs(cp, SEED)
    lens = cp.asarray(np.array([1000, 3, 517], np.int32)) if with_lens else None
    causal = kwargs.get("causal", False)
    mode = forward.CAUSAL_MODES[causal]
    owner = forward._builtin_mask(mode, q.shape[2], k.shape[2])
    omnicupy.attention(q, k, v, kv_lens=lens, **kwargs)
    assert any(type(r) is recall.ChainRecipe for r in owner._recipes.values()), "no decode recipe was kept"
    for i in range(3):
        seed = SEED + 30 + i
        q, k, v = _decode_inputs(cp, seed)
        if lens is not None:
            lens[...] = cp.asarray(np.random.default_rng(seed).integers(0, 1001, size=3).astype(np.int32))
        cached = omnicupy.attention(q, k, v, kv_lens=lens, **kwargs)
        owner._recipes.clear()
        general = omnicupy.attention(q, k, v, kv_lens=lens, **kwargs)
        for got, want in zip(cached if isinstance(cached, tuple) else [cached],
                             general if isinstance(general, tuple) else [general]):
            assert cp.array_equal(got, want), f"seed {seed}: the recipe and the general path differ ({kwargs})"


def test_decode_steps_return_while_the_device_is_busy_and_replay_in_a_graph():
    cp = pytest.importorskip("cupy")
    q, k, v = _decode_inputs(cp, SEED)
    lens = cp.asarray(np.array([10, 400, 999], np.int32))
    out = cp.empty_like(q)
    omnicupy.attention(q, k, v, kv_lens=lens, causal=True, out=out)  # kernels loaded, recipe kept
    lens += 0  # CuPy's own kernel for the steps below, compiled before the clock starts
    cp.cuda.Device().synchronize()
    _spin(cp)
    busy = cp.cuda.Event()
    busy.record()
    for step in range(3):
        lens += 1  # the next decode step: new lengths on the device, no host copy
        omnicupy.attention(q, k, v, kv_lens=lens, causal=True, out=out)
        assert not busy.done, f"decode step {step} waited for the device"
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        omnicupy.attention(q, k, v, kv_lens=lens, causal=True, out=out)
        graph = stream.end_capture()
    try:
        for new_lens in ([1, 2, 3], [999, 500, 0]):
            with stream:
                lens[...] = cp.asarray(np.array(new_lens, np.int32))
                out.fill(float("nan"))
                graph.launch(stream)
                want = omnicupy.attention(q, k, v, kv_lens=lens, causal=True)
            stream.synchronize()
            assert cp.array_equal(out, want), f"seed {SEED}: replay with kv_lens {new_lens}"
    finally:
        from omnicupy.ops import recall

        recall.release_captured()


# ------------------------------------------------------------------ paged_attention(validate=False)
def _paged_inputs(cp, seed, B=3, Hq=8, Hkv=2, Nq=1, D=128, num_pages=80, page_size=16, max_pages=24):
    rng = np.random.default_rng(seed)
    crng = cp.random.default_rng(seed)
    q = crng.standard_normal((B, Hq, Nq, D), dtype=cp.float32).astype(cp.float16)
    k_pages, v_pages = (crng.standard_normal((num_pages, page_size, Hkv, D), dtype=cp.float32).astype(cp.float16)
                        for _ in range(2))
    table = cp.asarray(rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32))
    lens = cp.asarray(rng.integers(1, max_pages * page_size + 1, size=B).astype(np.int32))
    return q, k_pages, v_pages, table, lens


@pytest.mark.parametrize("kwargs", [pytest.param({}, id="causal"), pytest.param({"return_lse": True}, id="lse"),
                                    pytest.param({"num_splits": 3, "window": 100}, id="window-3-splits")])
def test_paged_steady_state_matches_the_checked_call(kwargs):
    cp = pytest.importorskip("cupy")
    from omnicupy.ops import paged

    for i in range(3):
        seed = SEED + 40 + i
        args = _paged_inputs(cp, seed)
        fast = omnicupy.paged_attention(*args, validate=False, **kwargs)  # i > 0: the recipe
        assert paged._recipes, "no recipe was kept"
        checked = omnicupy.paged_attention(*args, **kwargs)  # validate=True: the general path, every time
        for got, want in zip(fast if isinstance(fast, tuple) else [fast],
                             checked if isinstance(checked, tuple) else [checked]):
            assert cp.array_equal(got, want), f"seed {seed}: {kwargs}"


def test_paged_decode_steps_do_not_wait_and_replay_in_a_graph():
    cp = pytest.importorskip("cupy")
    q, k_pages, v_pages, table, lens = _paged_inputs(cp, SEED)
    lens[...] = cp.asarray(np.array([10, 100, 200], np.int32))  # room for the steps below (capacity 384)
    out = cp.empty_like(q)
    omnicupy.paged_attention(q, k_pages, v_pages, table, lens, validate=False, out=out)
    lens += 0  # CuPy's kernel for the steps below, compiled before the clock starts
    cp.cuda.Device().synchronize()
    _spin(cp)
    busy = cp.cuda.Event()
    busy.record()
    for step in range(3):
        lens += 1
        omnicupy.paged_attention(q, k_pages, v_pages, table, lens, validate=False, out=out)
        assert not busy.done, f"paged decode step {step} waited for the device"
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        omnicupy.paged_attention(q, k_pages, v_pages, table, lens, validate=False, out=out)
        graph = stream.end_capture()
    try:
        for new_lens in ([1, 2, 3], [384, 200, 17]):
            with stream:
                lens[...] = cp.asarray(np.array(new_lens, np.int32))
                out.fill(float("nan"))
                graph.launch(stream)
                want = omnicupy.paged_attention(q, k_pages, v_pages, table, lens)
            stream.synchronize()
            assert cp.array_equal(out, want), f"seed {SEED}: replay with kv_lens {new_lens}"
    finally:
        from omnicupy.ops import recall

        recall.release_captured()
