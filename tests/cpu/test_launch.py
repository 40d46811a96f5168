"""jit/launch.py and the steady-state pieces of ops/recall.py without a GPU: the parameter bytes the
driver would read (through the very ``void*[1]`` it receives), per-thread buffers, launch errors,
pointer slots, the switch snapshot. Driver and cuda-bindings are stood in for by fakes that record
what they were given; the real launches are covered by tests/gpu/test_host_path_gpu.py."""
from __future__ import annotations

import ctypes
import os
import struct
import threading

import numpy as np
import pytest

from omnicupy.dispatch.params import BACKWARD, FORWARD
from omnicupy.errors import ArgumentError, OmnicupyError
from omnicupy.jit import launch
from omnicupy.ops import recall


class FakeKernel:
    name = "fake_kernel"

    def __init__(self, ptr=0x1234):
        self.function_ptr = ptr
        self.calls = []

    def __call__(self, grid, block, args, **kwargs):  # the CuPy-function route
        self.calls.append((grid, block, bytes(args[0]), kwargs))


def _read_params(argv_ptr: int, size: int) -> bytes:
    """What cuLaunchKernel would copy: kernelParams[0] points at the struct's bytes."""
    (target,) = struct.unpack("<Q", ctypes.string_at(argv_ptr, 8))
    return ctypes.string_at(target, size)


class FakeCupyDriver:
    class CUDADriverError(Exception):
        pass

    def __init__(self, size, fail=False):
        self.size, self.fail, self.calls = size, fail, []

    def launchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802 - CuPy's name
        if self.fail:
            raise self.CUDADriverError("CUDA_ERROR_INVALID_VALUE: invalid argument")
        self.calls.append(((f, gx, gy, gz, bx, by, bz, smem, stream, extra), _read_params(params, self.size)))


@pytest.fixture
def route(monkeypatch):
    """Select a launch route for one test (restored afterwards)."""
    monkeypatch.setattr(launch, "_ROUTE", [None])
    monkeypatch.setattr(launch, "_ROUTE_NAME", [None])
    monkeypatch.setattr(launch, "_ensure_context", lambda: None)  # no driver here

    def pick(name, driver=None, bindings=None):
        if driver is not None:
            monkeypatch.setattr(launch, "_cupy_driver", lambda: driver)
        if bindings is not None:
            monkeypatch.setattr(launch, "_bindings", lambda: bindings)
            monkeypatch.setattr(launch, "_handles", {})
        return launch.use_route(name)

    return pick


def _template(params=FORWARD) -> bytes:
    return bytes(range(256)) * (params.size // 256) + bytes(range(params.size % 256))


def test_driver_route_reads_the_written_struct(route):
    fake = FakeCupyDriver(FORWARD.size)
    route("driver", driver=fake)
    kernel = FakeKernel(0xF00)
    launcher = launch.Launcher(_template(), [launch.KernelLaunch(kernel, (3, 2, 1), (128, 1, 1), 4096)])
    slots = recall.PointerSlots(FORWARD.offset(n) for n in recall.POINTER_FIELDS)
    for pointers in [(0x1000, 0x2000, 0x3000, 0x4000, 0), (0x5000, 0x6000, 0x7000, 0x8000, 0x9000)]:
        slots.write(launcher.args(), pointers)
        launcher.launch(stream_ptr=0xBEEF)
        head, seen = fake.calls[-1]
        assert head == (0xF00, 3, 2, 1, 128, 1, 1, 4096, 0xBEEF, 0)
        expected = bytearray(_template())
        for name, ptr in zip(recall.POINTER_FIELDS, pointers):
            struct.pack_into("<Q", expected, FORWARD.offset(name), ptr)
        assert seen == bytes(expected)


def test_several_kernels_share_one_struct(route):
    fake = FakeCupyDriver(BACKWARD.size)
    route("driver", driver=fake)
    items = [launch.KernelLaunch(FakeKernel(p), (p, 1, 1), (256, 1, 1)) for p in (1, 2, 3)]
    launcher = launch.Launcher(_template(BACKWARD), items)
    launcher.launch(stream_ptr=7)
    assert [call[0][0] for call in fake.calls] == [1, 2, 3]
    assert all(call[1] == _template(BACKWARD) for call in fake.calls)


def test_each_thread_has_its_own_buffer(route):
    fake = FakeCupyDriver(FORWARD.size)
    route("driver", driver=fake)
    launcher = launch.Launcher(_template(), [launch.KernelLaunch(FakeKernel(), (1, 1, 1), (32, 1, 1))])
    barrier = threading.Barrier(2)
    addresses, errors = {}, []

    def worker(ptr):
        try:
            buf = launcher.args()
            struct.pack_into("<Q", buf, 0, ptr)
            barrier.wait(timeout=10)  # both threads have written before either launches
            launcher.launch(stream_ptr=0)
            addresses[ptr] = launcher._local.slot.bytes.ctypes.data
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(p,)) for p in (0xAAA0, 0xBBB0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(addresses.values())) == 2
    firsts = sorted(struct.unpack_from("<Q", seen, 0)[0] for _, seen in fake.calls)
    assert firsts == [0xAAA0, 0xBBB0]


def test_driver_refusal_is_a_launch_error(route):
    route("driver", driver=FakeCupyDriver(FORWARD.size, fail=True))
    launcher = launch.Launcher(_template(), [launch.KernelLaunch(FakeKernel(), (1, 1, 1), (32, 1, 1), 300000)])
    with pytest.raises(launch.LaunchError, match="fake_kernel.*300000 bytes.*INVALID_VALUE") as info:
        launcher.launch(stream_ptr=0)
    assert isinstance(info.value, OmnicupyError)


class FakeBindings:
    """cuda.bindings.driver as far as the bindings route uses it."""

    class CUfunction(int):
        pass

    class CUstream(int):
        pass

    def __init__(self, size, status=0):
        self.size, self.status, self.calls = size, status, []

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802
        self.calls.append(((f, gx, gy, gz, bx, by, bz, smem, stream, extra), _read_params(params, self.size)))
        return (self.status,)


@pytest.mark.parametrize("status", [pytest.param(0, id="ok"), pytest.param(700, id="illegal-address")])
def test_bindings_route(route, status):
    fake = FakeBindings(FORWARD.size, status)
    route("bindings", bindings=fake)
    launcher = launch.Launcher(_template(), [launch.KernelLaunch(FakeKernel(0xF0), (2, 1, 1), (64, 1, 1), 16)])
    if status:
        with pytest.raises(launch.LaunchError, match="700"):
            launcher.launch(stream_ptr=5)
        return
    launcher.launch(stream_ptr=5)
    launcher.launch(stream_ptr=5)
    (head, seen), (head2, _) = fake.calls
    assert head == (0xF0, 2, 1, 1, 64, 1, 1, 16, 5, 0) and seen == _template()
    assert head2[0] is head[0] and head2[8] is head[8]  # handle objects made once, not per call
    assert isinstance(head[0], FakeBindings.CUfunction) and isinstance(head[8], FakeBindings.CUstream)


def test_function_route_passes_the_struct_as_one_record(route):
    route("function")
    kernel = FakeKernel()
    launcher = launch.Launcher(_template(), [launch.KernelLaunch(kernel, (4, 1, 1), (128, 1, 1), 99)])
    struct.pack_into("<Q", launcher.args(), 8, 0xCAFE)
    launcher.launch()
    grid, block, seen, kwargs = kernel.calls[0]
    expected = bytearray(_template())
    struct.pack_into("<Q", expected, 8, 0xCAFE)
    assert (grid, block, seen) == ((4, 1, 1), (128, 1, 1), bytes(expected))
    assert kwargs == {"shared_mem": 99, "stream": None}


@pytest.mark.parametrize("name, error", [pytest.param("warp-drive", ArgumentError, id="unknown"),
                                         pytest.param("bindings", ArgumentError, id="unavailable")])
def test_unusable_route_is_refused(route, monkeypatch, name, error):
    monkeypatch.setattr(launch, "_bindings", lambda: None)
    with pytest.raises(error, match=name):
        route(name)


def test_bad_geometry_is_refused():
    with pytest.raises(launch.LaunchError, match="3 dimensions"):
        launch.KernelLaunch(FakeKernel(), (1, 1), (32, 1, 1))


@pytest.mark.parametrize("fields", [
    pytest.param(recall.POINTER_FIELDS, id="forward-one-run"),
    pytest.param(("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "lse_log2", "delta", "dq_accum",
                  "dq_semaphore"), id="backward-two-runs"),
])
def test_pointer_slots_write_every_pointer_and_nothing_else(fields):
    params = FORWARD if fields == recall.POINTER_FIELDS else BACKWARD
    slots = recall.PointerSlots(params.offset(n) for n in fields)
    buf = bytearray(_template(params))
    pointers = [0x10000 * (i + 1) for i in range(len(fields))]
    slots.write(memoryview(buf), pointers)
    got = params.unpack(bytes(buf))
    untouched = params.unpack(_template(params))
    for p in params.params:
        want = pointers[fields.index(p.name)] if p.name in fields else untouched[p.name]
        assert got[p.name] == want, p.name


def test_switches_follow_os_environ(monkeypatch):
    for name in recall.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    before = recall.switches()
    assert before == (None, None)
    monkeypatch.setenv("OMNICUPY_MMA", "sync")
    after = recall.switches()
    assert after != before and after[1] is None
    raw = after[0]
    assert (os.fsdecode(raw) if isinstance(raw, bytes) else raw) == "sync"
    monkeypatch.setenv("OMNICUPY_MMA", "wgmma")
    assert recall.switches() != after
    sig = recall.signature([(0, (1, 2), (4, 2), "f2", 0)], ("x",))
    assert sig == (((1, 2), (4, 2), "f2", 0), "x", *recall.switches())


def test_recipe_make_zeroes_the_pointers_and_keeps_the_metadata(route, monkeypatch):
    fake = FakeCupyDriver(FORWARD.size)
    route("driver", driver=fake)
    monkeypatch.setattr(launch, "_current_stream_ptr", lambda: 0x5EED)  # CuPy's current stream, without a GPU

    class Arr:  # an array the struct points at (ptr through .data.ptr, like CuPy's)
        def __init__(self, ptr):
            self.data = type("D", (), {"ptr": ptr})()

    meta = Arr(0x7000)
    fields = {p.name: (0 if p.count == 1 else []) for p in FORWARD.params}
    fields.update(q=Arr(0x100), k=Arr(0x200), v=Arr(0x300), o=Arr(0x400), kv_indices=meta, user_arrays=[Arr(0x800)],
                  num_heads=16)
    plan = type("P", (), {"grid": (8, 16, 2), "block": (128, 1, 1), "smem_bytes": 1024})()
    recipe = recall.Recipe.make(FakeKernel(9), plan, fields)
    unpacked = FORWARD.unpack(recipe.template)
    assert [unpacked[n] for n in recall.POINTER_FIELDS] == [0] * 5
    assert unpacked["kv_indices"] == 0x7000 and unpacked["num_heads"] == 16
    assert meta in recipe.keep and any(getattr(a.data, "ptr", 0) == 0x800 for a in recipe.keep)
    recipe.launch(0x1100, 0x1200, 0x1300, 0x1400, 0)
    head, seen = fake.calls[0]
    assert head == (9, 8, 16, 2, 128, 1, 1, 1024, 0x5EED, 0)
    assert [FORWARD.unpack(seen)[n] for n in recall.POINTER_FIELDS] == [0x1100, 0x1200, 0x1300, 0x1400, 0]


class _Arr:
    """A device array as the structs see it: ``.data.ptr`` and ``.nbytes``."""

    def __init__(self, ptr, nbytes=16):
        self.data = type("D", (), {"ptr": ptr})()
        self.nbytes = nbytes


class _FakeCupy:
    """CuPy as ChainRecipe.launch uses it: one pool allocation per call, a stream not capturing."""

    def __init__(self):
        self.allocations = []
        outer = self

        class _Memory:
            def __init__(self, n):
                self.ptr = 0x900000 + 0x10000 * len(outer.allocations)
                outer.allocations.append(n)

        stream = type("S", (), {"is_capturing": lambda self: False, "ptr": 0})()
        self.cuda = type("C", (), {"alloc": staticmethod(lambda n: _Memory(n)),
                                   "get_current_stream": staticmethod(lambda: stream)})()


def _decode_record(splits_lse=False):
    """What ops/decode.launch records for a split + combine call (pointers only; scalars zero)."""
    from omnicupy.dispatch.params import COMBINE, DECODE

    call = {"q": _Arr(0x1000), "k": _Arr(0x2000), "v": _Arr(0x3000), "o": _Arr(0x4000), "lse": _Arr(0x5000),
            "kv_lens": _Arr(0x6000)}
    part_o, part_ml, errors = _Arr(0x7000, 1000), _Arr(0x8000, 100), _Arr(0xE000)
    split = {p.name: (0 if p.count == 1 else []) for p in DECODE.params}
    split.update({n: call[n] for n in ("q", "k", "v", "o", "kv_lens")}, lse=None, part_o=part_o, part_ml=part_ml,
                 errors=errors, page_table=None, num_heads=8)
    combine = {p.name: 0 for p in COMBINE.params}
    combine.update(part_o=part_o, part_ml=part_ml, o=call["o"], lse=call["lse"], rows=64)
    record = [(launch.KernelLaunch(FakeKernel(0xA), (4, 8, 2), (128, 1, 1), 2048), DECODE, split),
              (launch.KernelLaunch(FakeKernel(0xB), (1, 1, 1), (256, 1, 1), 0), COMBINE, combine)]
    return record, {name: a.data.ptr for name, a in call.items()}, errors


def test_chain_recipe_replays_split_and_combine_with_new_pointers(route, monkeypatch):
    from omnicupy.dispatch.params import COMBINE, DECODE

    sizes = {0xA: DECODE.size, 0xB: COMBINE.size}

    class Driver(FakeCupyDriver):
        def launchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802
            self.calls.append((f, _read_params(params, sizes[f])))

    fake = Driver(0)
    route("driver", driver=fake)
    monkeypatch.setattr(launch, "_current_stream_ptr", lambda: 0)
    record, first_call, errors = _decode_record()
    chain = recall.ChainRecipe.from_record(record, first_call, ("part_o", "part_ml"))
    assert chain is not None and errors in chain.keep
    fake_cp = _FakeCupy()
    new = {"q": 0x11000, "k": 0x12000, "v": 0x13000, "o": 0x14000, "lse": 0x15000, "kv_lens": 0x16000}
    chain.launch(fake_cp, new)
    assert fake_cp.allocations == [1024 + 256]  # part_o rounded up to 256 bytes, then part_ml
    (f1, split), (f2, combine) = fake.calls
    assert (f1, f2) == (0xA, 0xB)
    s, c = DECODE.unpack(split), COMBINE.unpack(combine)
    for name in ("q", "k", "v", "o", "kv_lens"):
        assert s[name] == new[name], name
    assert s["lse"] == 0 and s["errors"] == 0xE000 and s["num_heads"] == 8  # fixed fields stay
    assert (s["part_o"], s["part_ml"]) == (0x900000, 0x900000 + 1024) == (c["part_o"], c["part_ml"])
    assert (c["o"], c["lse"], c["rows"]) == (new["o"], new["lse"], 64)


def test_chain_recipe_refuses_a_call_whose_array_was_copied():
    record, first_call, _ = _decode_record()
    first_call["q"] += 0x100  # the struct holds another array than the call's q
    assert recall.ChainRecipe.from_record(record, first_call, ("part_o", "part_ml")) is None


class _DecodeArray(_Arr):
    """A device array as ops/decode.launch reads it: pointer, shape, element strides, itemsize."""

    def __init__(self, ptr, shape, itemsize=2):
        super().__init__(ptr, itemsize * int(np.prod(shape)))
        self.shape, self.itemsize = shape, itemsize
        self.strides = tuple(int(s) for s in np.empty(shape, np.dtype(f"f{itemsize}")).strides)


@pytest.mark.parametrize("fused", [pytest.param(True, id="fused-combine"), pytest.param(False, id="combine-kernel")])
def test_decode_first_call_launches_like_its_replay(route, monkeypatch, fused):
    """The decode's first call (ops/decode.launch) goes through a Launcher, as its replays
    (ChainRecipe) do: never CuPy's Function.__call__; and both hand the driver the same structs,
    pointers aside from the per-call fp32 partials (scratch)."""
    from omnicupy import arrays, jit
    from omnicupy.dispatch.params import COMBINE, DECODE
    from omnicupy.ops import decode

    sizes = {0xA: DECODE.size, 0xB: COMBINE.size}

    class Driver(FakeCupyDriver):
        def launchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):  # noqa: N802
            self.calls.append(((f, gx, gy, gz, bx, by, bz, smem), _read_params(params, sizes[f])))

    fake = Driver(0)
    route("driver", driver=fake)
    monkeypatch.setattr(launch, "_current_stream_ptr", lambda: 0)
    kernels = {"decode": FakeKernel(0xA), "combine": FakeKernel(0xB)}
    monkeypatch.setattr(jit, "get_kernel", lambda variant: kernels[variant.operation])
    fake_cp = _FakeCupy()
    allocated = iter(range(0x100000, 0x200000, 0x10000))
    fake_cp.empty = lambda shape, dtype: _DecodeArray(next(allocated), shape, np.dtype(dtype).itemsize)
    fake_cp.zeros = fake_cp.empty
    fake_cp.cuda.runtime = type("R", (), {"getDevice": staticmethod(lambda: 0)})()
    monkeypatch.setattr(arrays, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(decode, "_error_words", {})
    monkeypatch.setattr(decode, "_split_counters", {})

    B, Hq, Hkv, Nq, N, D = 2, 8, 2, 1, 4096, 128
    q, o = _DecodeArray(0x1000, (B, Hq, Nq, D)), _DecodeArray(0x4000, (B, Hq, Nq, D))
    k, v = _DecodeArray(0x2000, (B, Hkv, N, D)), _DecodeArray(0x3000, (B, Hkv, N, D))
    lens = _DecodeArray(0x6000, (B,), 4)
    plan = decode.plan_split_kv(head_dim=D, dtype="fp16", batch=B, heads=Hq, kv_heads=Hkv, q_len=Nq, longest=N,
                                rows=decode.pack_rows(Hq // Hkv, Nq), rule=decode.Rule(causal=True, bottom_right=True),
                                num_splits=4, arch="sm_90", fused_combine=fused)
    record = []
    decode.launch(plan, q, decode.KVSource.contiguous(k, v), o, None, 0.125, kv_lens=lens, record=record)
    first = list(fake.calls)
    assert [head[0] for head, _ in first] == ([0xA] if fused else [0xA, 0xB])
    assert not any(kernel.calls for kernel in kernels.values()), "a launch went through Function.__call__"

    call = {"q": q, "k": k, "v": v, "o": o, "lse": None, "kv_lens": lens}
    chain = recall.ChainRecipe.from_record(record, {n: None if a is None else a.data.ptr for n, a in call.items()},
                                           decode.SCRATCH_FIELDS)
    chain.launch(fake_cp, {n: 0 if a is None else a.data.ptr for n, a in call.items()})
    replay = fake.calls[len(first):]
    assert [head for head, _ in replay] == [head for head, _ in first]
    for (head, got), (_, want) in zip(replay, first):
        params = DECODE if head[0] == 0xA else COMBINE
        got, want = params.unpack(got), params.unpack(want)
        for name in decode.SCRATCH_FIELDS:  # per-call partials: another allocation, same size
            got.pop(name), want.pop(name)
        assert got == want
