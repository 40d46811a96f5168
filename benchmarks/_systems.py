"""The GPU side: inputs, the systems under test, timing and the correctness check.

Needs CuPy and a GPU. torch is optional and imported only here, lazily: without it omnicupy runs
alone. Inputs are torch tensors when torch is present (CuPy views of them, zero-copy through
DLPack, go to omnicupy), else CuPy arrays.
"""
from __future__ import annotations

import contextlib
import math
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import _cases, _report

#: Relative Frobenius error allowed against the float64 reference (docs/design.md, Semantics).
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2}
#: The same for each gradient of the backward passes (every system rounds P and dS to 16 bits).
GRAD_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}
#: Inputs rotate among enough copies to exceed this many times the L2 cache.
L2_MULTIPLE = 4
MIN_COPIES, MAX_COPIES = 2, 16
CHECK_ROWS = 64
DYNAMO_LIMIT = 1000


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def host_f64(x: Any) -> np.ndarray:
    """A float64 NumPy copy of a torch tensor or CuPy array (fp16 or bf16)."""
    if _is_torch(x):
        return x.detach().float().cpu().numpy().astype(np.float64)
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    import cupy as cp

    try:
        return np.asarray(cp.asnumpy(x)).astype(np.float64)
    except Exception:  # noqa: BLE001 - a CuPy without bf16 host copies: rebuild floats from the bits
        if x.itemsize != 2:
            raise
        bits = cp.asnumpy(x.view(cp.uint16)).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)


# --------------------------------------------------------------------------- the machine
class Gpu:
    """CuPy, torch (or None) and facts about the current device."""

    def __init__(self, want_torch: bool) -> None:
        import cupy as cp

        self.cp = cp
        self.device_id = cp.cuda.runtime.getDevice()
        props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        name = props.get("name", b"?")
        self.name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        self.l2_bytes = int(props.get("l2CacheSize", 0) or 50 * 2**20)
        self.torch = None
        self.torch_problem = "not requested"
        if want_torch:
            try:
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("torch.cuda.is_available() is False")
                self.torch = torch
                self.torch_problem = ""
            except Exception as exc:  # noqa: BLE001 - torch is optional
                self.torch_problem = f"{type(exc).__name__}: {exc}"

    def sync(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    def free(self) -> None:
        """Give cached blocks back between shapes so both allocators fit."""
        self.sync()
        self.cp.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def meta(self) -> dict:
        return {"device": self.name, "driver": _driver(self.cp), "versions": self.versions(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def versions(self) -> dict:
        import cupy as cp

        import omnicupy

        out = {"python": platform.python_version(), "numpy": np.__version__, "cupy": cp.__version__,
               "omnicupy": omnicupy.__version__}
        try:
            rt = cp.cuda.runtime.runtimeGetVersion()
            out["cuda_runtime"] = f"{rt // 1000}.{rt % 1000 // 10}"
        except Exception:  # noqa: BLE001
            pass
        try:
            from omnicupy.jit.compiler import nvrtc_version

            out["nvrtc"] = ".".join(map(str, nvrtc_version()))
        except Exception:  # noqa: BLE001
            pass
        if self.torch is not None:
            out["torch"] = self.torch.__version__
            try:
                out["cudnn"] = str(self.torch.backends.cudnn.version())
            except Exception:  # noqa: BLE001
                pass
            try:
                import triton

                out["triton"] = triton.__version__
            except Exception:  # noqa: BLE001
                pass
        return out


def _driver(cp) -> str:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            text = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20).stdout.strip().splitlines()
            if text:
                return text[0].strip()
        except Exception:  # noqa: BLE001
            pass
    try:
        v = cp.cuda.runtime.driverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001
        return "unknown"


# --------------------------------------------------------------------------- inputs
@dataclass
class Inputs:
    """``copies`` independent (q, k, v) sets of one shape; the first is the one checked."""

    cupy_sets: list
    torch_sets: Optional[list]
    #: output gradients per set for the backward passes: (CuPy, torch or None), made on first use
    _douts: Optional[list] = None

    def douts(self, seed: int) -> list:
        """One random dO per input set, as (CuPy array, torch tensor or None) sharing memory."""
        if self._douts is None:
            import cupy as cp

            rng = cp.random.default_rng(seed)
            made = []
            for q, _, _ in self.cupy_sets:
                d = rng.standard_normal(q.shape, dtype=cp.float32)
                try:
                    d = d.astype(q.dtype)
                except Exception:  # noqa: BLE001 - a CuPy that cannot cast to bf16 on the device
                    d = cp.asarray(cp.asnumpy(d).astype(q.dtype))
                made.append(d)
            if self.torch_sets is not None:
                import torch

                self._douts = [(d, torch.from_dlpack(d)) for d in made]
            else:
                self._douts = [(d, None) for d in made]
        return self._douts

    @property
    def copies(self) -> int:
        return len(self.cupy_sets)

    def native(self, i: int = 0) -> tuple:
        return self.torch_sets[i] if self.torch_sets is not None else self.cupy_sets[i]


def copies_for(set_bytes: int, l2_bytes: int) -> int:
    return max(MIN_COPIES, min(MAX_COPIES, math.ceil(L2_MULTIPLE * l2_bytes / max(1, set_bytes))))


def make_inputs(gpu: Gpu, case: _cases.Case, seed: int) -> Inputs:
    """Unit-variance random q, k, v ``[B, H, N, D]``, rotated so the L2 never holds them."""
    cp = gpu.cp
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)
    copies = copies_for(3 * 2 * math.prod(shape), gpu.l2_bytes)
    if gpu.torch is not None:
        torch = gpu.torch
        dtype = torch.float16 if case.dtype == "fp16" else torch.bfloat16
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        torch_sets = [tuple(torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
                      for _ in range(copies)]
        cupy_sets = [tuple(cp.from_dlpack(t) for t in s) for s in torch_sets]
        return Inputs(cupy_sets, torch_sets)
    from omnicupy import arrays

    dtype = np.dtype(np.float16) if case.dtype == "fp16" else arrays.BFLOAT16
    rng = cp.random.default_rng(seed)

    def randn():
        x = rng.standard_normal(shape, dtype=cp.float32)
        try:
            return x.astype(dtype)
        except Exception:  # noqa: BLE001 - a CuPy that cannot cast to bf16 on the device
            return cp.asarray(cp.asnumpy(x).astype(dtype))

    return Inputs([tuple(randn() for _ in range(3)) for _ in range(copies)], None)


def device_normal(cp, shape, dtype, rng, chunk: int = 1 << 24):
    """Unit normals of ``dtype`` drawn on the device by ``rng`` (a CuPy Generator) in chunks of
    ``chunk`` elements: no float32 copy of a multi-GB array, and one launch per chunk rather than per
    row of a packed [total, H, D] array (the decode benchmark, lab/tools/dec_prefill.py and the
    bench-sized decode tests draw their caches with it)."""
    out = cp.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, chunk):
        n = min(chunk, flat.size - start)
        flat[start:start + n] = rng.standard_normal(n, dtype=cp.float32).astype(out.dtype)
    return out


# --------------------------------------------------------------------------- reference
class Reference:
    """float64 reference rows for a sample of queries of one or two (b, h) pairs of input set 0."""

    def __init__(self, mask: _cases.MaskCase, case: _cases.Case, inputs: Inputs, seed: int) -> None:
        from omnicupy import reference

        self._reference = reference
        n = case.seq_len
        rng = np.random.default_rng([seed, n, case.head_dim])
        picks = rng.choice(n, size=min(n, CHECK_ROWS - 2), replace=False)
        self.rows = np.unique(np.concatenate([[0, n - 1], picks]))
        self.heads = sorted({(0, 0), (case.batch - 1, case.heads - 1)})
        allowed = mask.rows(self.rows)[None, None]
        q, k, v = inputs.native(0)
        expected = []
        for b, h in self.heads:
            qh = host_f64(q[b, h])[self.rows]
            kh, vh = host_f64(k[b, h]), host_f64(v[b, h])
            expected.append(reference.attention(qh[None, None], kh[None, None], vh[None, None], allowed)[0, 0])
        self.expected = np.concatenate(expected)

    def error(self, out: Any) -> float:
        """Relative Frobenius error of ``out`` on the sampled rows; inf for NaN/inf."""
        actual = np.concatenate([host_f64(out[b, h])[self.rows] for b, h in self.heads])
        return self._reference.relative_error(actual, self.expected)


class GradReference:
    """float64 gradients (dq, dk, dv) of two (b, h) pairs of input set 0, computed on the GPU with
    CuPy from the element mask (every row: a gradient of k or v sums over all queries)."""

    def __init__(self, mask: _cases.MaskCase, case: _cases.Case, inputs: Inputs, seed: int) -> None:
        cp = _cupy()
        n = case.seq_len
        self.heads = sorted({(0, 0), (case.batch - 1, case.heads - 1)})
        allowed = cp.asarray(mask.rows(np.arange(n)))
        q, k, v = inputs.cupy_sets[0]
        dout = inputs.douts(seed)[0][0]
        scale = 1.0 / math.sqrt(case.head_dim)
        self.expected = []
        for b, h in self.heads:
            qh, kh, vh, dh = (device_f64(x[b, h]) for x in (q, k, v, dout))
            s = cp.where(allowed, (qh @ kh.T) * scale, -cp.inf)
            row_max = s.max(axis=1, keepdims=True)
            p = cp.exp(s - cp.where(cp.isfinite(row_max), row_max, 0.0))
            del s
            total = p.sum(axis=1, keepdims=True)
            p /= cp.where(total > 0, total, 1.0)
            dp = dh @ vh.T
            dp -= (p * dp).sum(axis=1, keepdims=True)  # dP - rowsum(dO * O)
            dp *= p  # dS
            self.expected.append(((dp @ kh) * scale, (dp.T @ qh) * scale, p.T @ dh))
            del p, dp
        cp.get_default_memory_pool().free_all_blocks()

    def error(self, grads: Any) -> float:
        """The largest relative Frobenius error of dq, dk, dv over the two heads; inf for NaN/inf."""
        cp = _cupy()
        worst = 0.0
        for i in range(3):
            got = cp.concatenate([device_f64(grads[i][b, h]).ravel() for b, h in self.heads])
            want = cp.concatenate([e[i].ravel() for e in self.expected])
            if not bool(cp.isfinite(got).all()):
                return float("inf")
            worst = max(worst, float(cp.linalg.norm(got - want) / cp.linalg.norm(want)))
        return worst


def _cupy():
    import cupy as cp

    return cp


def device_f64(x: Any):
    """A float64 CuPy copy of a torch tensor or CuPy array (fp16 or bf16), on the device."""
    cp = _cupy()
    if _is_torch(x):
        return cp.from_dlpack(x.detach().float().contiguous()).astype(cp.float64)
    try:
        return x.astype(cp.float64)
    except Exception:  # noqa: BLE001 - a CuPy without bf16 casts: rebuild floats from the bits
        bits = x.view(cp.uint16).astype(cp.uint32) << 16
        return bits.view(cp.float32).astype(cp.float64)


def reference_for(mask: _cases.MaskCase, case: _cases.Case, bench: "Bench", seed: int):
    """The check of a case: sampled output rows (forward) or two heads' gradients (backward passes)."""
    if case.pass_name == "fwd":
        return Reference(mask, case, bench.inputs, seed)
    return GradReference(mask, case, bench.inputs, bench.seed)


# --------------------------------------------------------------------------- systems
class System:
    """A way to compute attention on a case. ``prepare`` returns ``fn(i)`` on input set i (the
    forward); ``prepare_pass`` the function the case's pass times (forward, backward, or both)."""

    name = ""
    needs_torch = False

    def prepare(self, case: _cases.Case, mask: _cases.MaskCase, bench: "Bench") -> Callable[[int], Any]:
        raise NotImplementedError

    def prepare_pass(self, case: _cases.Case, mask: _cases.MaskCase, bench: "Bench") -> Callable[[int], Any]:
        if case.pass_name == "fwd":
            return self.prepare(case, mask, bench)
        return self.prepare_backward(case, mask, bench, with_forward=case.pass_name == "fwdbwd")

    def prepare_backward(self, case, mask, bench, with_forward: bool) -> Callable[[int], Any]:
        """``fn(i)`` returning (dq, dk, dv) for input set i: the backward of a forward run here once
        per set (``with_forward``: the forward inside fn too)."""
        raise NotImplementedError(f"{self.name} has no backward pass")

    def context(self):
        return contextlib.nullcontext()

    def clock(self, gpu: Gpu) -> "Clock":
        return Clock.for_torch(gpu) if self.needs_torch else Clock.for_cupy(gpu)


class Omnicupy(System):
    def __init__(self, name: str, stages: Optional[int], deterministic: bool = False) -> None:
        self.name = name
        self.stages = stages
        self.deterministic = deterministic

    def prepare(self, case, mask, bench):
        import omnicupy

        bm = bench.omnicupy_mask(mask)
        sets, stages = bench.inputs.cupy_sets, self.stages
        return lambda i: omnicupy.attention(*sets[i], bm, stages=stages)

    def prepare_backward(self, case, mask, bench, with_forward):
        import omnicupy

        bm = bench.omnicupy_mask(mask)
        sets, stages, det = bench.inputs.cupy_sets, self.stages, self.deterministic
        douts = [d for d, _ in bench.inputs.douts(bench.seed)]
        if with_forward:
            def fn(i):
                out, lse = omnicupy.attention(*sets[i], bm, stages=stages, return_lse=True)
                return omnicupy.attention_backward(douts[i], *sets[i], out, lse, bm, deterministic=det)
            return fn
        saved = [omnicupy.attention(*s, bm, stages=stages, return_lse=True) for s in sets]
        return lambda i: omnicupy.attention_backward(douts[i], *sets[i], *saved[i], bm, deterministic=det)


class TorchBackward:
    """The backward of a torch attention function through autograd: ``attend(q, k, v)`` on leaves
    that share the inputs' memory; gradients by ``torch.autograd.grad``."""

    def attend(self, case, mask, bench) -> Callable:
        raise NotImplementedError

    def prepare_backward(self, case, mask, bench, with_forward):
        import torch

        attend = self.attend(case, mask, bench)
        leaves = [tuple(t.detach().requires_grad_() for t in s) for s in bench.inputs.torch_sets]
        douts = [t for _, t in bench.inputs.douts(bench.seed)]
        if with_forward:
            return lambda i: torch.autograd.grad(attend(*leaves[i]), leaves[i], douts[i])
        outs = [attend(*leaf) for leaf in leaves]
        return lambda i: torch.autograd.grad(outs[i], leaves[i], douts[i], retain_graph=True)


class Flex(TorchBackward, System):
    name = _cases.FLEX
    needs_torch = True

    def prepare(self, case, mask, bench):
        attend, sets = self.attend(case, mask, bench), bench.inputs.torch_sets
        return lambda i: attend(*sets[i])

    def attend(self, case, mask, bench):
        flex, bm = bench.flex_function(), bench.flex_mask(mask)
        return lambda q, k, v: flex(q, k, v, block_mask=bm)


class Sdpa(TorchBackward, System):
    needs_torch = True

    def __init__(self, name: str, backend: str) -> None:
        self.name = name
        self.backend = backend

    def context(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, self.backend)])

    def prepare(self, case, mask, bench):
        attend, sets = self.attend(case, mask, bench), bench.inputs.torch_sets
        return lambda i: attend(*sets[i])

    def attend(self, case, mask, bench):
        import torch.nn.functional as F

        causal = case.mask == "causal"
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def make_systems(names: list[str]) -> list[System]:
    table = {_cases.OMNICUPY: lambda: Omnicupy(_cases.OMNICUPY, None), _cases.FLEX: Flex,
             _cases.OMNICUPY_DETERMINISTIC: lambda: Omnicupy(_cases.OMNICUPY_DETERMINISTIC, None, deterministic=True),
             _cases.SDPA_FLASH: lambda: Sdpa(_cases.SDPA_FLASH, "FLASH_ATTENTION"),
             _cases.SDPA_CUDNN: lambda: Sdpa(_cases.SDPA_CUDNN, "CUDNN_ATTENTION")}
    out = []
    for name in names:
        if name.startswith("omnicupy_stage"):
            out.append(Omnicupy(name, int(name[len("omnicupy_stage"):])))
        else:
            out.append(table[name]())
    return out


# --------------------------------------------------------------------------- timing
@dataclass
class Clock:
    """CUDA events of the library that launches the work (both record on the legacy default stream)."""

    event: Callable[[], Any]
    elapsed_ms: Callable[[Any, Any], float]
    sync: Callable[[], None]

    @classmethod
    def for_cupy(cls, gpu: Gpu) -> "Clock":
        cp = gpu.cp
        return cls(lambda: cp.cuda.Event(), lambda s, e: cp.cuda.get_elapsed_time(s, e), gpu.sync)

    @classmethod
    def for_torch(cls, gpu: Gpu) -> "Clock":
        torch = gpu.torch
        return cls(lambda: torch.cuda.Event(enable_timing=True), lambda s, e: s.elapsed_time(e), gpu.sync)


def time_ms(fn: Callable[[int], Any], copies: int, clock: Clock, warmup: int, rep: int) -> float:
    """Median of ``rep`` event-timed calls after ``warmup`` calls, cycling through input sets."""
    for i in range(warmup):
        fn(i % copies)
    clock.sync()
    events = [(clock.event(), clock.event()) for _ in range(rep)]
    for r, (start, stop) in enumerate(events):
        start.record()
        fn((warmup + r) % copies)
        stop.record()
    clock.sync()
    return _report.median(clock.elapsed_ms(s, e) for s, e in events)


def cupy_time_ms(fn: Callable[[], Any], warmup: int = 3, reps: int = 10) -> float:
    """Median of ``reps`` CuPy-event-timed calls of ``fn()`` after ``warmup`` calls, each synchronized
    (the scripts that time one call at a time: bench_features.py and the lab's tuning scripts)."""
    import cupy as cp

    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


# --------------------------------------------------------------------------- one run
class Bench:
    """State shared across cases: block masks (built once per mask and N), flex's compiled function,
    the current inputs, and the side records (mask build times, first-call times, errors)."""

    def __init__(self, gpu: Gpu, *, warmup: int, rep: int, check: bool, mask_repeats: int, cache_label: str,
                 seed: int = _cases.SEED, log: Callable[[str], None] = print) -> None:
        self.gpu = gpu
        self.warmup, self.rep, self.check = warmup, rep, check
        self.mask_repeats = mask_repeats
        self.cache_label = cache_label
        self.seed = seed
        self.log = log
        self.device = "cuda"  # where torch-side masks live
        self.inputs: Optional[Inputs] = None
        self.mask_build: list[dict] = []
        self._built: list[dict] = []  # this process's builds (mask_build may also hold resumed ones)
        self.first_call: list[dict] = []
        self.mask_info: list[dict] = []
        self._omnicupy_masks: dict = {}
        self._flex_masks: dict = {}
        self._pairs: dict = {}
        self._flex = None

    # masks ------------------------------------------------------------------
    def pairs(self, mask: _cases.MaskCase) -> int:
        key = (mask.name, mask.seq_len)
        if key not in self._pairs:
            self._pairs[key] = _cases.count_pairs(mask.array_mod(), mask.seq_len, xp=self.gpu.cp, chunk_elems=1 << 24)
            self.mask_info.append({"mask": mask.name, "seq_len": mask.seq_len, "pairs": self._pairs[key],
                                   "density": round(_cases.density(self._pairs[key], mask.seq_len), 6)})
        return self._pairs[key]

    def _timed_build(self, build: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, float, Optional[float]]:
        """(result, first ms, median ms of the ``mask_repeats`` repeats or None without repeats).

        The first build of a (mask, N) carries one-time costs: in a fresh process, the first builds
        that use a CuPy elementwise kernel include CuPy compiling (or loading) it, seconds once."""
        times, result = [], None
        for _ in range(1 + self.mask_repeats):
            start = time.perf_counter()
            result = build()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        return result, times[0], (_report.median(times[1:]) if len(times) > 1 else None)

    def _record_build(self, system: str, mask: _cases.MaskCase, builder: str, first: float,
                      steady: Optional[float], **extra: Any) -> dict:
        """One ``mask_build`` entry: ``first_ms`` (the first build of this mask at this N, one-time
        costs included; ``first_in_process`` marks the system's first build of the run) and
        ``steady_ms`` (median of ``repeats`` further builds; None when there were none)."""
        entry = {"system": system, "mask": mask.name, "seq_len": mask.seq_len, "builder": builder,
                 "first_ms": round(first, 3), "steady_ms": None if steady is None else round(steady, 3),
                 "repeats": self.mask_repeats,
                 "first_in_process": not any(e.get("system") == system for e in self._built)}
        entry.update(extra)
        self._built.append(entry)
        self.mask_build.append(entry)
        return entry

    @staticmethod
    def _build_words(entry: dict) -> str:
        steady = entry["steady_ms"]
        words = (f"steady {steady:.2f} ms (median of {entry['repeats']}); " if steady is not None else "") + \
            f"first {entry['first_ms']:.1f} ms"
        if entry["first_in_process"]:
            words += " (first build in this process: includes one-time setup such as kernel compiles)"
        return words

    def _cached(self, cache: dict, mask: _cases.MaskCase, make: Callable[[], Any]):
        """``make()`` once per (mask, N); a failure is remembered and re-raised briefly."""
        key = (mask.name, mask.seq_len)
        if key not in cache:
            try:
                cache[key] = make()
            except Exception as exc:
                cache[key] = RuntimeError(f"building this mask failed earlier: {type(exc).__name__}: {exc}")
                raise
        if isinstance(cache[key], Exception):
            raise cache[key]
        return cache[key]

    def omnicupy_mask(self, mask: _cases.MaskCase):
        return self._cached(self._omnicupy_masks, mask, lambda: self._build_omnicupy_mask(mask))

    def flex_mask(self, mask: _cases.MaskCase):
        return self._cached(self._flex_masks, mask, lambda: self._build_flex_mask(mask))

    def _build_omnicupy_mask(self, mask: _cases.MaskCase):
        from omnicupy import BlockMask

        n = mask.seq_len
        if mask.name == "full":
            how, build0 = "BlockMask.full", lambda: BlockMask.full(n, n)
        elif mask.name == "causal":
            how, build0 = "BlockMask.causal", lambda: BlockMask.causal(n, n)
        else:
            mod, source, note = _cases.resolve_product_mod(mask, _cases.masks_module())
            if note:
                self.log(f"note: {mask.name}: {note}; omnicupy uses the benchmark's rule")
            how = f"BlockMask.from_mask_mod({source}, None, None, N, N)"
            build0 = lambda: BlockMask.from_mask_mod(mod, None, None, n, n)  # noqa: E731

        def build():
            bm = build0()
            bm.device_metadata()  # the device copy is part of making the mask usable
            return bm

        bm, first, steady = self._timed_build(build, self.gpu.sync)
        entry = self._record_build("omnicupy", mask, how, first, steady)
        self.log(f"  mask {mask.name} N={n}: omnicupy {how}: {self._build_words(entry)}; {bm!r}")
        return bm

    def _build_flex_mask(self, mask: _cases.MaskCase):
        from torch.nn.attention.flex_attention import create_block_mask

        n, device = mask.seq_len, self.device
        extra: dict = {}
        if mask.flex_dense:
            # The rule, evaluated once into a dense bool [N, N] tensor (not part of the timed build):
            # flex's kernel cannot be compiled with the random rule inlined (shared memory).
            start = time.perf_counter()
            dense = self.gpu.torch.from_numpy(mask.dense()).to(device)
            self.gpu.sync()
            extra["dense_ms"] = round((time.perf_counter() - start) * 1e3, 3)
            mod = _cases.dense_mod(dense, mask.name)
            how = "create_block_mask(lambda b, h, q, kv: dense[q, kv])"
        else:
            mod, how = mask.torch_mod(device), "create_block_mask"
        bm, first, steady = self._timed_build(lambda: create_block_mask(mod, None, None, n, n, device=device),
                                              self.gpu.sync)
        entry = self._record_build("flex", mask, how, first, steady, **extra)
        dense_words = f"; dense [N, N] table from the rule in {extra['dense_ms']:.0f} ms" if extra else ""
        self.log(f"  mask {mask.name} N={n}: flex {how}: {self._build_words(entry)}{dense_words}")
        return bm

    def flex_function(self):
        """flex_attention under torch.compile(dynamic=False), with dynamo's recompile limits raised so
        that a new shape or mask recompiles instead of silently falling back to eager."""
        if self._flex is None:
            import torch
            import torch._dynamo

            cfg = torch._dynamo.config
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(cfg, name):
                    try:
                        setattr(cfg, name, DYNAMO_LIMIT)
                    except Exception:  # noqa: BLE001 - a renamed or read-only alias
                        pass
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention, dynamic=False)
        return self._flex

    # one system on one case ---------------------------------------------------
    def run(self, system: System, case: _cases.Case, mask: _cases.MaskCase,
            reference: Callable[[], Reference]) -> dict:
        """Check, then time ``system`` on ``case``; returns the row. Raises on failure."""
        pairs = self.pairs(mask)
        dens = _cases.density(pairs, case.seq_len)
        clock = system.clock(self.gpu)
        with system.context():
            fn = system.prepare_pass(case, mask, self)
            clock.sync()
            start = time.perf_counter()
            out = fn(0)
            clock.sync()
            first = time.perf_counter() - start
            self.first_call.append({"system": system.name, "mask": case.mask, "head_dim": case.head_dim,
                                    "seq_len": case.seq_len, "dtype": case.dtype, "seconds": round(first, 4),
                                    "cache": self.cache_label})
            correct, err = None, None
            tolerance = (TOLERANCE if case.pass_name == "fwd" else GRAD_TOLERANCE)[case.dtype]
            if self.check:
                err = reference().error(out)
                correct = bool(err <= tolerance)  # NaN/inf compare False
            del out
            if correct is False:
                self.log(f"  {system.name:16s} WRONG: relative error {err:.3e} > {tolerance:.0e} "
                         f"(first call {first:.2f} s); not timed")
                return _report.make_row(system.name, case, dens, pairs, None, False)
            ms = time_ms(fn, self.inputs.copies, clock, self.warmup, self.rep)
        row = _report.make_row(system.name, case, dens, pairs, ms, correct)
        checked = "unchecked" if err is None else f"err {err:.1e}"
        speed = "?" if row["tflops"] is None else f"{row['tflops']:.1f}"
        self.log(f"  {system.name:16s} {speed:>8s} TFLOP/s {ms:9.3f} ms  {checked}  first call {first:.2f} s")
        return row


def print_exception(context: str) -> str:
    """Print the current traceback to stderr; return 'Type: message' for the record."""
    import traceback

    exc = sys.exc_info()[1]
    print(f"--- {context} ---", file=sys.stderr)
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()
    return f"{type(exc).__name__}: {exc}"[:2000]


__all__ = ["Gpu", "Inputs", "make_inputs", "Reference", "GradReference", "reference_for", "System", "make_systems",
           "time_ms", "Bench", "TOLERANCE", "GRAD_TOLERANCE", "host_f64", "device_f64", "copies_for",
           "print_exception"]
