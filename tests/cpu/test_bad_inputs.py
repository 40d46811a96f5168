"""The battery of bad inputs (issue 36): every public entry point, each bad input answered by a
specific named omnicupy error before anything is launched, on the CPU.

Tables of ``(id, call, error, message)``: ``call`` builds its arguments and calls the entry point;
the error must be exactly that omnicupy kind (or a subclass), never NoGPUError for an input that
can be judged without a GPU, never a raw Python or CUDA error. Inputs that need a GPU to judge
(device arrays' values) are the gpu-marked cases of tests/cpu/test_hardening.py.
"""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, cuda_mask, distributed, masks, score_mods
from omnicupy.errors import (AliasError, ArgumentError, CacheError, ExpressionError, HeadDimError, KVCacheError,
                             MaskError, NoGPUError, OmnicupyError, SizeLimitError)
from omnicupy.mask.expressions import CudaExpr
from omnicupy.score_mods import ScoreMod, cuda_score

B, H, N, D = 1, 2, 128, 64


def arr(shape=(B, H, N, D), dtype=np.float16):
    return np.zeros(shape, dtype)


Q = arr()
K = arr()
V = arr()
LSE = np.zeros((B, H, N), np.float32)
CAUSAL = BlockMask.causal(N, N)
DOC = {"doc": np.zeros(N, np.int32)}


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


class FakeCudaArray:
    """An object claiming to be a CUDA array at a made-up address."""

    __cuda_array_interface__ = {"shape": (B, H, N, D), "typestr": "<f2", "data": (0x1234, False), "version": 3,
                                "strides": None}


CASES: list = []


def add(table: str, cases) -> None:
    for case_id, call, error, *match in cases:
        CASES.append(pytest.param(call, error, match[0] if match else None, id=f"{table}-{case_id}"))


# ------------------------------------------------------------------ arrays, for every operation
BAD_QKV = [
    ("q-3d", lambda: (arr((H, N, D)), K, V), ArgumentError, "4-D"),
    ("q-5d", lambda: (arr((1, B, H, N, D)), K, V), ArgumentError, "4-D"),
    ("q-float32", lambda: (arr(dtype=np.float32), K, V), ArgumentError),
    ("q-float64", lambda: (arr(dtype=np.float64), K, V), ArgumentError),
    ("q-int32", lambda: (arr(dtype=np.int32), K, V), ArgumentError),
    ("q-bool", lambda: (arr(dtype=bool), K, V), ArgumentError),
    ("q-complex", lambda: (arr(dtype=np.complex64), K, V), ArgumentError),
    ("qkv-mixed-dtypes", lambda: (Q, arr(dtype=np.float32), V), ArgumentError),
    ("q-zero-batch", lambda: (arr((0, H, N, D)), K, V), ArgumentError, "zero-size"),
    ("q-zero-len", lambda: (arr((B, H, 0, D)), K, V), ArgumentError, "zero-size"),
    ("k-zero-len", lambda: (Q, arr((B, H, 0, D)), arr((B, H, 0, D))), ArgumentError, "zero-size"),
    ("q-last-dim-strided", lambda: (arr((B, H, N, 2 * D))[..., ::2], K, V), ArgumentError, "contiguous"),
    ("head-dim-7", lambda: (arr((B, H, N, 7)),) * 3, HeadDimError),
    ("head-dim-12", lambda: (arr((B, H, N, 12)),) * 3, HeadDimError),
    ("head-dim-264", lambda: (arr((B, H, 8, 264)),) * 3, HeadDimError),
    ("head-dim-512", lambda: (arr((B, H, 8, 512)),) * 3, HeadDimError),
    ("k-batch", lambda: (Q, arr((2, H, N, D)), arr((2, H, N, D))), ArgumentError, "batch"),
    ("k-head-dim", lambda: (Q, arr((B, H, N, 32)), arr((B, H, N, 32))), ArgumentError, "head_dim"),
    ("kv-shapes-differ", lambda: (Q, K, arr((B, H, 64, D))), ArgumentError, "same shape"),
    ("gqa-not-divisible", lambda: (arr((B, 3, N, D)), K, V), ArgumentError, "multiple"),
    ("kv-heads-more-than-q", lambda: (arr((B, 1, N, D)), K, V), ArgumentError, "multiple"),
    ("batch-past-grid", lambda: (np.broadcast_to(arr((1, 1, 8, D)), (70000, 1, 8, D)),
                                 np.broadcast_to(arr((1, 1, 8, D)), (70000, 1, 8, D)),
                                 np.broadcast_to(arr((1, 1, 8, D)), (70000, 1, 8, D))), SizeLimitError),
    ("heads-past-grid", lambda: (np.broadcast_to(arr((1, 1, 8, D)), (1, 70000, 8, D)),
                                 np.broadcast_to(arr((1, 1, 8, D)), (1, 70000, 8, D)),
                                 np.broadcast_to(arr((1, 1, 8, D)), (1, 70000, 8, D))), SizeLimitError),
    ("q-None", lambda: (None, K, V), ArgumentError),
    ("q-string", lambda: ("q", K, V), ArgumentError),
    ("q-dict", lambda: ({"q": 1}, K, V), ArgumentError),
    ("q-int", lambda: (3, K, V), ArgumentError),
    ("q-object", lambda: (object(), K, V), ArgumentError),
    ("k-None", lambda: (Q, None, V), ArgumentError),
    ("v-None", lambda: (Q, K, None), ArgumentError),
]

BAD_OPTIONS = [  # keyword arguments shared by attention() and plan()
    ("causal-string", {"causal": "yes"}, ArgumentError, "causal"),
    ("causal-2", {"causal": 2}, ArgumentError, "causal"),
    ("causal-list", {"causal": [True]}, ArgumentError, "causal"),
    ("causal-float", {"causal": 0.5}, ArgumentError, "causal"),
    ("causal-and-mask", {"causal": True, "block_mask": CAUSAL}, ArgumentError, "either"),
    ("mask-string", {"block_mask": "causal"}, ArgumentError, "BlockMask"),
    ("mask-array", {"block_mask": np.ones((N, N), bool)}, ArgumentError, "BlockMask"),
    ("mask-wrong-q-len", {"block_mask": BlockMask.causal(256, 128)}, MaskError),
    ("mask-wrong-kv-len", {"block_mask": BlockMask.causal(128, 256)}, MaskError),
    ("mask-wrong-heads", {"block_mask": BlockMask.from_mask_mod(masks.causal(), 1, 3, N, N)}, MaskError),
    ("mask-wrong-batch", {"block_mask": BlockMask.from_mask_mod(masks.causal(), 2, 1, N, N)}, MaskError),
    ("stages-0", {"stages": 0}, ArgumentError, "stages"),
    ("stages-3", {"stages": 3}, ArgumentError, "stages"),
    ("stages-string", {"stages": "2"}, ArgumentError, "stages"),
    ("stages-float", {"stages": 1.5}, ArgumentError, "stages"),
    ("stages-bool", {"stages": True}, ArgumentError, "stages"),
    ("fuse-mask-string", {"fuse_mask": "yes"}, ArgumentError, "fuse_mask"),
    ("fuse-mask-int", {"fuse_mask": 1}, ArgumentError, "fuse_mask"),
    ("fuse-mask-None", {"fuse_mask": None}, ArgumentError, "fuse_mask"),
    ("bias-int", {"bias": np.zeros((B, H, N), np.int32)}, ArgumentError, "bias"),
    ("bias-float64", {"bias": np.zeros((B, H, N), np.float64)}, ArgumentError, "bias"),
    ("bias-2d", {"bias": np.zeros((H, N), np.float32)}, ArgumentError, "bias"),
    ("bias-5d", {"bias": np.zeros((1, B, H, N, N), np.float32)}, ArgumentError, "bias"),
    ("bias-wrong-kv", {"bias": np.zeros((B, H, N + 1), np.float32)}, ArgumentError, "broadcast"),
    ("bias-wrong-heads", {"bias": np.zeros((B, 3, N), np.float32)}, ArgumentError, "broadcast"),
    ("bias-wrong-q", {"bias": np.zeros((B, H, N + 1, N), np.float32)}, ArgumentError, "broadcast"),
    ("bias-string", {"bias": "zeros"}, ArgumentError),
    ("score-mod-string", {"score_mod": "softcap"}, ArgumentError),
    ("score-mod-int", {"score_mod": 1}, ArgumentError),
    ("score-mod-lambda", {"score_mod": lambda s, b, h, q, k: s}, ArgumentError),
    ("score-mod-array-too-short", {"score_mod": cuda_score("score + t[q_idx]", arrays={"t": np.ones(4, np.float32)})},
     ExpressionError, "elements"),
]
BAD_SCALES = [0, -1, -0.0, float("nan"), float("inf"), -float("inf"), "1", True, None if False else 1e39, 1e-45,
              complex(1, 0), [1.0], np.float64(np.inf)]
BAD_OPTIONS += [(f"scale-{i}", {"scale": s}, ArgumentError, "scale") for i, s in enumerate(BAD_SCALES)]

ATTENTION_ONLY = [
    ("return-lse-int", {"return_lse": 1}, ArgumentError, "return_lse"),
    ("return-lse-string", {"return_lse": "no"}, ArgumentError, "return_lse"),
    ("out-wrong-shape", {"out": arr((B, H, N, 32))}, ArgumentError, "out"),
    ("out-wrong-dtype", {"out": arr(dtype=np.float32)}, ArgumentError, "out"),
    ("out-readonly", {"out": readonly(Q)}, AliasError, "read-only"),
    ("out-is-q", {"out": Q}, AliasError, "shares memory with q"),
    ("out-is-k", {"out": K}, AliasError, "shares memory with k"),
    ("out-is-v", {"out": V}, AliasError, "shares memory with v"),
    ("out-zero-stride", {"out": np.broadcast_to(arr((B, H, 1, D)), Q.shape)}, AliasError),
    ("out-strided-last", {"out": arr((B, H, N, 2 * D))[..., ::2]}, ArgumentError, "contiguous"),
    ("out-list", {"out": [[0.0]]}, ArgumentError),
    ("decode-kv-lens-negative", {"kv_lens": [-5]}, KVCacheError, "kv_lens"),
    ("decode-kv-lens-past-cache", {"kv_lens": [N + 1]}, KVCacheError, "kv_lens"),
    ("decode-kv-lens-2d", {"kv_lens": [[1]]}, ArgumentError, "kv_lens"),
    ("decode-kv-lens-long", {"kv_lens": [1, 2]}, ArgumentError, "kv_lens"),
    ("decode-kv-lens-float", {"kv_lens": np.array([1.5])}, ArgumentError, "kv_lens"),
    ("decode-kv-lens-string", {"kv_lens": "12"}, ArgumentError, "kv_lens"),
    ("decode-splits-0", {"num_splits": 0}, ArgumentError, "num_splits"),
    ("decode-splits-negative", {"num_splits": -2}, ArgumentError, "num_splits"),
    ("decode-splits-float", {"num_splits": 1.5}, ArgumentError, "num_splits"),
    ("decode-splits-string", {"num_splits": "2"}, ArgumentError, "num_splits"),
    ("decode-splits-bool", {"num_splits": True}, ArgumentError, "num_splits"),
    ("decode-splits-huge", {"num_splits": 10**9}, ArgumentError, "num_splits"),
]

for case_id, make, error, *match in BAD_QKV:
    add("attention", [(case_id, lambda make=make: omnicupy.attention(*make()), error, *match)])
    add("plan", [(case_id, lambda make=make: omnicupy.plan(*make(), arch="sm_80"), error, *match)])
    add("backward", [(case_id, lambda make=make: omnicupy.attention_backward(arr(), *make(), arr(), LSE), error,
                      *match)])
    add("backward-plan", [(case_id, lambda make=make: omnicupy.ops.backward.plan(*make(), arch="sm_80"), error,
                           *match)])
for case_id, kwargs, error, *match in BAD_OPTIONS:
    add("attention", [(case_id, lambda kw=kwargs: omnicupy.attention(Q, K, V, **kw), error, *match)])
    if "stages" not in kwargs and "scale" not in kwargs and not case_id.startswith("score-mod-array"):
        add("backward", [(case_id, lambda kw=kwargs: omnicupy.attention_backward(arr(), Q, K, V, arr(), LSE, **kw),
                          error, *match)])
    if "scale" not in kwargs:
        add("plan", [(case_id, lambda kw=kwargs: omnicupy.plan(Q, K, V, arch="sm_80", **kw), error, *match)])
for case_id, kwargs, error, *match in ATTENTION_ONLY:
    q1 = arr((B, H, 1, D)) if "kv_lens" in kwargs or "num_splits" in kwargs else Q
    add("attention", [(case_id, lambda kw=kwargs, q1=q1: omnicupy.attention(q1, K, V, **kw), error, *match)])
add("attention", [("fake-cuda-array-interface", lambda: omnicupy.attention(FakeCudaArray(), K, V), NoGPUError,
                   "omnicupy.attention")])


# ------------------------------------------------------------------ backward: its own arguments and outputs
def backward(**kw):
    args = dict(dout=arr(), q=Q, k=K, v=V, out=arr(), lse=LSE, causal=True)
    args.update(kw)
    return omnicupy.attention_backward(args.pop("dout"), args.pop("q"), args.pop("k"), args.pop("v"), args.pop("out"),
                                       args.pop("lse"), **args)


SHARED_GRAD = arr()
add("backward", [
    ("dq-is-q", lambda: backward(dq=Q), AliasError, "dq shares memory with q"),
    ("dk-is-k", lambda: backward(dk=K), AliasError, "dk shares memory with k"),
    ("dv-is-v", lambda: backward(dv=V), AliasError, "dv shares memory with v"),
    ("dk-is-dv", lambda: backward(dk=SHARED_GRAD, dv=SHARED_GRAD), AliasError, "dk shares memory with dv"),
    ("dq-is-dk", lambda: backward(dq=SHARED_GRAD, dk=SHARED_GRAD), AliasError, "dq shares memory with dk"),
    ("dq-half-of-dv", lambda: backward(dq=np.zeros((B, H, N, D), np.float16),
                                       dv=(big := np.zeros((B, H, 2 * N, D), np.float16))[:, :, :N],
                                       dk=big[:, :, N // 2:N // 2 + N]), AliasError, "dk shares memory with dv"),
    ("dq-is-dout", lambda: backward(dout=SHARED_GRAD, dq=SHARED_GRAD), AliasError, "dq shares memory with dout"),
    ("dq-is-out", lambda: backward(out=SHARED_GRAD, dq=SHARED_GRAD), AliasError, "dq shares memory with out"),
    ("dv-is-out", lambda: backward(out=SHARED_GRAD, dv=SHARED_GRAD), AliasError, "dv shares memory with out"),
    ("dq-readonly", lambda: backward(dq=readonly(Q)), AliasError, "read-only"),
    ("dk-zero-stride", lambda: backward(dk=np.broadcast_to(arr((B, H, 1, D)), Q.shape)), AliasError),
    ("dq-wrong-shape", lambda: backward(dq=arr((B, H, N, 32))), ArgumentError, "dq"),
    ("dk-wrong-dtype", lambda: backward(dk=arr(dtype=np.float32)), ArgumentError, "dk"),
    ("dv-strided", lambda: backward(dv=arr((B, H, N, 2 * D))[..., ::2]), ArgumentError, "dv"),
    ("lse-None", lambda: backward(lse=None), ArgumentError, "lse"),
    ("lse-wrong-shape", lambda: backward(lse=np.zeros((B, H, N + 1), np.float32)), ArgumentError, "lse"),
    ("lse-float16", lambda: backward(lse=np.zeros((B, H, N), np.float16)), ArgumentError, "lse"),
    ("out-wrong-shape", lambda: backward(out=arr((B, H, N, 32))), ArgumentError, "out"),
    ("dout-wrong-dtype", lambda: backward(dout=arr(dtype=np.float32)), ArgumentError, "dout"),
    ("deterministic-int", lambda: backward(deterministic=1), ArgumentError, "deterministic"),
    ("deterministic-string", lambda: backward(deterministic="yes"), ArgumentError, "deterministic"),
    ("score-mod-without-grad", lambda: backward(score_mod=cuda_score("score * 2.0f")), ArgumentError, "derivative"),
    ("grad-other-constants", lambda: backward(score_mod=ScoreMod(score_mods.softcap(30.0).cuda,
                                                                 grad=CudaExpr.make("1.0f"))), ArgumentError, "same"),
    ("no-gpu-names-backward", lambda: backward(), NoGPUError, "omnicupy.attention_backward"),
])
INJECTIONS = ['1.0f); }\nextern "C" __global__ void injected(int* p) { *p = 1; } static float x = (1.0f',
              "1.0f; asm(\"trap;\")", "1.0f /* */", "#include <x>", "1.0f}", "score; score",
              "__builtin_trap()", "::omni::tanh_fast(score)", "1.0f\n+ 1.0f", "1.0f\\", "(*(&score))", "score = 1.0f"]
for i, text in enumerate(INJECTIONS):
    def hand_made(text=text):
        base = score_mods.softcap(30.0)
        grad = CudaExpr(text, base.cuda.constants, base.cuda.array_decls)  # bypasses CudaExpr.make
        return backward(score_mod=ScoreMod(base.cuda, grad=grad))
    add("backward", [(f"hand-made-grad-{i}", hand_made, ExpressionError)])


# ------------------------------------------------------------------ paged attention
PAGES = np.zeros((4, 16, H, D), np.float16)
TABLE = np.zeros((B, 4), np.int32)
LENS = np.array([10], np.int32)
Q1 = arr((B, H, 1, D))


def paged(**kw):
    args = dict(q=Q1, k_pages=PAGES, v_pages=PAGES, page_table=TABLE, kv_lens=LENS)
    args.update(kw)
    return omnicupy.paged_attention(args.pop("q"), args.pop("k_pages"), args.pop("v_pages"), args.pop("page_table"),
                                    args.pop("kv_lens"), **args)


add("paged", [
    ("layout-unknown", lambda: paged(layout="XYZ"), ArgumentError, "layout"),
    ("pages-3d", lambda: paged(k_pages=PAGES[0], v_pages=PAGES[0]), ArgumentError, "4-D"),
    ("pages-dtype", lambda: paged(k_pages=PAGES.astype(np.float32), v_pages=PAGES.astype(np.float32)), ArgumentError),
    ("pages-differ", lambda: paged(v_pages=PAGES[:2]), ArgumentError, "same shape"),
    ("pages-head-dim", lambda: paged(k_pages=PAGES[..., :32], v_pages=PAGES[..., :32]), ArgumentError),
    ("pages-heads", lambda: paged(k_pages=np.zeros((4, 16, 3, D), np.float16),
                                  v_pages=np.zeros((4, 16, 3, D), np.float16)), ArgumentError, "multiple"),
    ("q-3d", lambda: paged(q=Q1[0]), ArgumentError),
    ("q-head-dim", lambda: paged(q=arr((B, H, 1, 12))), HeadDimError),
    ("table-float", lambda: paged(page_table=TABLE.astype(np.float32)), ArgumentError),
    ("table-1d", lambda: paged(page_table=TABLE[0]), ArgumentError),
    ("table-batch", lambda: paged(page_table=np.zeros((2, 4), np.int32)), ArgumentError),
    ("table-negative", lambda: paged(page_table=np.full((B, 4), -1, np.int32)), KVCacheError),
    ("table-past-pool", lambda: paged(page_table=np.full((B, 4), 4, np.int32)), KVCacheError),
    ("lens-negative", lambda: paged(kv_lens=np.array([-5], np.int32)), KVCacheError),
    ("lens-past-capacity", lambda: paged(kv_lens=np.array([65], np.int32)), KVCacheError),
    ("lens-None", lambda: paged(kv_lens=None), ArgumentError, "kv_lens"),
    ("lens-float", lambda: paged(kv_lens=np.array([1.0])), ArgumentError),
    ("lens-2", lambda: paged(kv_lens=np.array([1, 2], np.int32)), ArgumentError),
    ("causal-string", lambda: paged(causal="yes"), ArgumentError, "causal"),
    ("causal-int", lambda: paged(causal=1), ArgumentError, "causal"),
    ("window-0", lambda: paged(window=0), ArgumentError, "window"),
    ("window-negative", lambda: paged(window=-3), ArgumentError, "window"),
    ("window-float", lambda: paged(window=1.5), ArgumentError, "window"),
    ("validate-string", lambda: paged(validate="no"), ArgumentError, "validate"),
    ("validate-int", lambda: paged(validate=0), ArgumentError, "validate"),
    ("return-lse-string", lambda: paged(return_lse="yes"), ArgumentError, "return_lse"),
    ("splits-0", lambda: paged(num_splits=0), ArgumentError, "num_splits"),
    ("scale-0", lambda: paged(scale=0), ArgumentError, "scale"),
    ("scale-nan", lambda: paged(scale=float("nan")), ArgumentError, "scale"),
    ("score-mod-string", lambda: paged(score_mod="alibi"), ArgumentError),
    ("out-wrong-shape", lambda: paged(out=arr((B, H, 2, D))), ArgumentError, "out"),
    ("out-is-q", lambda: paged(out=Q1), AliasError, "shares memory with q"),
    ("out-readonly", lambda: paged(out=readonly(Q1)), AliasError, "read-only"),
    ("out-in-the-pages", lambda: paged(out=PAGES.reshape(-1)[:H * D].reshape(B, H, 1, D)), AliasError, "k_pages"),
    ("no-gpu-names-paged", lambda: paged(), NoGPUError, "omnicupy.paged_attention"),
])


# ------------------------------------------------------------------ varlen
PQ = np.zeros((N, H, D), np.float16)
CU = np.array([0, 64, N], np.int32)


def varlen(**kw):
    args = dict(q=PQ, k=PQ, v=PQ, cu_seqlens_q=CU, cu_seqlens_k=CU)
    args.update(kw)
    return omnicupy.varlen_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens_q"),
                                     args.pop("cu_seqlens_k"), **args)


add("varlen", [
    ("q-4d", lambda: varlen(q=Q), ArgumentError),
    ("q-2d", lambda: varlen(q=PQ[0]), ArgumentError),
    ("kv-differ", lambda: varlen(v=PQ[:64], cu_seqlens_k=np.array([0, 64], np.int32)), ArgumentError),
    ("cu-not-from-0", lambda: varlen(cu_seqlens_q=np.array([1, 64, N], np.int32)), ArgumentError),
    ("cu-decreasing", lambda: varlen(cu_seqlens_q=np.array([0, 100, 64, N], np.int32)), ArgumentError),
    ("cu-short-total", lambda: varlen(cu_seqlens_q=np.array([0, 64], np.int32)), ArgumentError),
    ("cu-past-total", lambda: varlen(cu_seqlens_q=np.array([0, 64, N + 1], np.int32)), ArgumentError),
    ("cu-float", lambda: varlen(cu_seqlens_q=CU.astype(np.float32)), ArgumentError),
    ("cu-2d", lambda: varlen(cu_seqlens_q=CU[None]), ArgumentError),
    ("cu-one-entry", lambda: varlen(cu_seqlens_q=np.array([0], np.int32)), ArgumentError),
    ("cu-counts-differ", lambda: varlen(cu_seqlens_k=np.array([0, N], np.int32)), ArgumentError),
    ("causal-string", lambda: varlen(causal="yes"), ArgumentError, "causal"),
    ("out-wrong-shape", lambda: varlen(out=PQ[:64]), ArgumentError, "out"),
    ("out-wrong-dtype", lambda: varlen(out=PQ.astype(np.float32)), ArgumentError, "out"),
    ("out-is-q", lambda: varlen(out=PQ), AliasError, "shares memory with q"),
    ("out-readonly", lambda: varlen(out=readonly(PQ)), AliasError, "read-only"),
    ("out-readonly-empty-keys", lambda: varlen(k=PQ[:0], v=PQ[:0], cu_seqlens_k=np.array([0, 0, 0], np.int32),
                                               out=readonly(PQ)), AliasError, "read-only"),
    ("scale-negative", lambda: varlen(scale=-1.0), ArgumentError, "scale"),
])


# ------------------------------------------------------------------ BlockMask constructor and immutability
NB = np.ones((1, 1, 1), np.int32)
IDX = np.zeros((1, 1, 1, 1), np.int32)
FULL_T = np.full((1, 1, 1, 1), 2, np.int32)


def block_mask(nb=NB, idx=IDX, types=FULL_T, **kw):
    args = dict(q_len=N, kv_len=N)
    args.update(kw)
    return BlockMask(nb, idx, types, **args)


add("block-mask", [
    ("nb-2d", lambda: block_mask(nb=NB[0]), MaskError, "dimensions"),
    ("idx-3d", lambda: block_mask(idx=IDX[0]), MaskError, "dimensions"),
    ("types-float", lambda: block_mask(types=FULL_T.astype(np.float32)), MaskError, "integer"),
    ("idx-int64-huge", lambda: block_mask(idx=np.full((1, 1, 1, 1), 2**40)), MaskError, "range"),
    ("nb-None", lambda: block_mask(nb=None), MaskError, "required"),
    ("nb-negative", lambda: block_mask(nb=-NB), MaskError, "negative"),
    ("nb-past-slots", lambda: block_mask(nb=NB * 2), MaskError, "larger"),
    ("idx-negative", lambda: block_mask(idx=IDX - 1), MaskError, "outside"),
    ("idx-past-blocks", lambda: block_mask(idx=IDX + 1), MaskError, "outside"),
    ("idx-10-6", lambda: block_mask(idx=IDX + 10**6), MaskError, "outside"),
    ("type-4", lambda: block_mask(types=FULL_T + 2), MaskError, "block_mask_types"),
    ("type-negative", lambda: block_mask(types=-FULL_T), MaskError, "block_mask_types"),
    ("duplicate", lambda: block_mask(nb=NB * 2, idx=np.zeros((1, 1, 1, 2), np.int32),
                                     types=np.full((1, 1, 1, 2), 2, np.int32), kv_len=256), MaskError, "twice"),
    ("causal-off-band", lambda: BlockMask(np.ones((1, 1, 2), np.int32), np.array([[[[1], [0]]]], np.int32),
                                          np.ones((1, 1, 2, 1), np.int32), q_len=256, kv_len=256), MaskError,
     "CAUSAL"),
    ("partial-without-pool", lambda: block_mask(types=FULL_T + 1), MaskError, "PARTIAL"),
    ("pool-shape", lambda: block_mask(types=FULL_T + 1, partial_block_mask_indices=IDX,
                                      partial_block_masks=np.zeros((1, 64, 4), np.uint32)), MaskError, "shape"),
    ("pool-index-past", lambda: block_mask(types=FULL_T + 1, partial_block_mask_indices=IDX + 1,
                                           partial_block_masks=np.zeros((1, 128, 4), np.uint32)), MaskError, "pool"),
    ("pool-without-indices", lambda: block_mask(partial_block_masks=np.zeros((1, 128, 4), np.uint32)), MaskError,
     "together"),
    ("q-blocks-mismatch", lambda: block_mask(q_len=2 * N + 1), MaskError, "q blocks"),
    ("shape-mismatch", lambda: block_mask(types=np.full((1, 1, 1, 2), 2, np.int32)), MaskError, "shape"),
])
for name, value in [("q_len", 0), ("q_len", -1), ("q_len", "128"), ("q_len", 1.5), ("q_len", True), ("q_len", 2**40),
                    ("kv_len", 0), ("kv_len", None), ("kv_len", 2**33), ("q_block_size", 100), ("q_block_size", 0),
                    ("kv_block_size", 48), ("kv_block_size", -128), ("kv_block_size", "128")]:
    add("block-mask", [(f"{name}-{value!r}", lambda n=name, v=value: block_mask(**{n: v}), MaskError, name)])
for attribute in ("kv_num_blocks", "kv_indices", "block_mask_types", "partial_block_mask_indices",
                  "partial_block_masks", "q_len", "kv_len", "q_block_size", "kv_block_size", "mask_mod", "rule",
                  "features", "summary", "q_block_work", "_kv_indices", "_kv_num_blocks", "_fingerprint",
                  "_sealed", "_runs", "anything_new"):
    add("block-mask-frozen", [
        (f"assign-{attribute}", lambda a=attribute: setattr(BlockMask.causal(512, 512), a, np.full((1,), -7)),
         MaskError, "cannot be changed"),
        (f"delete-{attribute}", lambda a=attribute: delattr(BlockMask.causal(512, 512), a), MaskError, "deleted"),
    ])
for method, kwargs in [("to_string", {"batch": 5}), ("to_string", {"batch": -1}), ("to_string", {"head": 3}),
                       ("to_string", {"head": -1}), ("to_string", {"batch": "0"}), ("to_string", {"width": 0}),
                       ("to_string", {"width": 1.5})]:
    add("block-mask-inspect", [(f"{method}-{kwargs}", lambda m=method, kw=kwargs: getattr(CAUSAL, m)(**kw),
                                MaskError)])


# ------------------------------------------------------------------ builders
add("builders", [
    ("causal-q-0", lambda: BlockMask.causal(0, N), MaskError),
    ("causal-kv-string", lambda: BlockMask.causal(N, "128"), MaskError),
    ("causal-block-100", lambda: BlockMask.causal(N, N, q_block_size=100), MaskError),
    ("full-negative", lambda: BlockMask.full(-1, N), MaskError),
    ("full-huge", lambda: BlockMask.full(2**40, N), MaskError),
    ("mask-mod-not-callable", lambda: BlockMask.from_mask_mod("causal", None, None, N, N), MaskError),
    ("mask-mod-B-0", lambda: BlockMask.from_mask_mod(masks.causal(), 0, None, N, N), MaskError),
    ("mask-mod-H-string", lambda: BlockMask.from_mask_mod(masks.causal(), None, "2", N, N), MaskError),
    ("mask-mod-q-len-0", lambda: BlockMask.from_mask_mod(masks.causal(), None, None, 0, N), MaskError),
    ("mask-mod-wrong-result", lambda: BlockMask.from_mask_mod(lambda b, h, q, k: "yes", None, None, N, N), MaskError),
    ("mask-mod-wrong-shape", lambda: BlockMask.from_mask_mod(lambda b, h, q, k: np.ones(3, bool), None, None, N, N),
     MaskError),
    ("dense-1d", lambda: BlockMask.from_dense(np.ones(N, bool)), MaskError),
    ("dense-float", lambda: BlockMask.from_dense(np.ones((N, N), np.float32) * 0.5), MaskError),
    ("dense-empty", lambda: BlockMask.from_dense(np.ones((0, N), bool)), MaskError),
    ("dense-string", lambda: BlockMask.from_dense("mask"), MaskError),
    ("block-types-3d", lambda: BlockMask.from_block_types(np.zeros((1, 1, 1), np.int8), q_len=N, kv_len=N),
     MaskError),
    ("block-types-value-7", lambda: BlockMask.from_block_types(np.full((1, 1, 1, 1), 7, np.int8), q_len=N, kv_len=N),
     MaskError),
])


# ------------------------------------------------------------------ masks zoo
ZOO = [
    ("causal-offset-2**40", lambda: masks.causal(2**40)),
    ("causal-offset-float", lambda: masks.causal(1.5)),
    ("causal-offset-string", lambda: masks.causal("0")),
    ("causal-offset-past-int32", lambda: masks.causal(-2**31 - 1)),
    ("local-window-negative", lambda: masks.local_window(-1, 0)),
    ("local-window-huge", lambda: masks.local_window(0, 2**31)),
    ("local-window-float", lambda: masks.local_window(0.5, 1)),
    ("prefix-negative", lambda: masks.prefix_lm(-1)),
    ("prefix-huge", lambda: masks.prefix_lm(2**40)),
    ("prefix-bool", lambda: masks.prefix_lm(True)),
    ("dilated-window-0", lambda: masks.dilated_sliding_window(0, 1)),
    ("dilated-dilation-0", lambda: masks.dilated_sliding_window(4, 0)),
    ("dilated-product-past-int32", lambda: masks.dilated_sliding_window(2**20, 2**20)),
    ("doc-lengths-0", lambda: masks.doc_ids_from_lengths([0])),
    ("doc-lengths-negative", lambda: masks.doc_ids_from_lengths([4, -1])),
    ("doc-lengths-total", lambda: masks.doc_ids_from_lengths([2**30, 2**30])),
    ("doc-lengths-float", lambda: masks.doc_ids_from_lengths([1.5])),
    ("document-3d", lambda: masks.document(np.zeros((2, 2, 2), np.int32))),
    ("document-float", lambda: masks.document(np.zeros(4, np.float32) + 0.5)),
    ("document-empty", lambda: masks.document(np.zeros(0, np.int32))),
    ("document-string", lambda: masks.document("abc")),
    ("block-diagonal-0", lambda: masks.block_diagonal([0])),
    ("block-diagonal-huge", lambda: masks.block_diagonal([2**40])),
    ("interleaved-empty", lambda: masks.interleaved([])),
    ("interleaved-kind", lambda: masks.interleaved([("audio", 4)])),
    ("interleaved-length-0", lambda: masks.interleaved([("text", 0)])),
    ("interleaved-not-pairs", lambda: masks.interleaved(["text"])),
    ("interleaved-total", lambda: masks.interleaved([("text", 2**30), ("image", 2**30)])),
    ("and-masks-string", lambda: masks.and_masks("causal")),
    ("and-masks-none", lambda: masks.and_masks()),
    ("or-masks-int", lambda: masks.or_masks(1, 2)),
    ("not-mask-none", lambda: masks.not_mask(None)),
    ("dense-3d", lambda: masks.dense(np.ones((2, 2, 2), bool))),
    ("dense-string", lambda: masks.dense("x")),
]
ZOO += [(f"sliding-window-{v!r}", lambda v=v: masks.sliding_window(v))
        for v in (0, -1, 2**31, 2**40, 1.5, "1", True, None, np.float32(4))]
add("masks", [(case_id, call, MaskError) for case_id, call in ZOO])

# ------------------------------------------------------------------ score modifiers
add("score-mods", [(f"softcap-{v!r}", lambda v=v: score_mods.softcap(v), ArgumentError)
                   for v in (0, -1.0, float("nan"), float("inf"), "30", True, 1e-39, None, 1e39, [30.0])])
add("score-mods", [(f"alibi-{v!r}", lambda v=v: score_mods.alibi(v), ArgumentError)
                   for v in (0, -1, 70000, 1.5, True, "8", None)])

# ------------------------------------------------------------------ expressions: grammar, constants, arrays, indices
BAD_TEXTS = [
    "", "   ", "q_idx >= kv_idx;", "q_idx >= kv_idx; while(1){}", "{q_idx}", "#define X 1", "%:define X",
    "q_idx <% kv_idx", "q_idx /* c */ > 0", "q_idx // c", "q_idx = 1", "q_idx++ > 0", "--q_idx > 0",
    "q_idx\n> 0", "q_idx\t> 0", "q_idx > 0 ? 1", "q_idx : 1", "(q_idx > 0", "q_idx > 0)", "q_idx[0] > 0",
    "*q_idx > 0", "&q_idx != 0", "foo(q_idx)", "printf(\"x\")", "'a' > 0", "q_idx > 0x10", "q_idx > 010",
    "q_idx > 1e999", "q_idx > 99999999999999999999", "q_idx.x > 0", "q_idx->x > 0", "std::min(q_idx, 1) > 0",
    "sizeof(q_idx) > 0", "(long)q_idx > 0", "q_idx ?? 1", "score > 0", "q_idx > 0, 1", "tanhf > 0",
    "asm(\"trap;\")", "__syncthreads()", "q_idx <=> kv_idx", "q_idx ... kv_idx", "\\u0041 > 0", "ä > 0",
    "q_idx > 0 \\", "q_idx @ 1", "q_idx $ 1", "`q_idx`", "() > 0", "min() > 0",
]
add("cuda-mask-text", [(f"{i}", lambda t=t: cuda_mask(t), ExpressionError) for i, t in enumerate(BAD_TEXTS)])
add("cuda-score-text", [(f"{i}", lambda t=t: cuda_score(t.replace("score > 0", "score; 1")), ExpressionError)
                        for i, t in enumerate(BAD_TEXTS)])
BAD_INDICES = [
    ("issue-sum", "doc[q_idx + kv_idx] > 0", {}),
    ("issue-difference", "doc[q_idx - kv_idx] > 0", {}),
    ("issue-plus-one-declared", "doc[q_idx + 1] > 0", {"extents": {"doc": "q_idx"}}),
    ("plus-one", "doc[q_idx + 1] > 0", {}),
    ("minus-one", "doc[q_idx - 1] > 0", {}),
    ("negated", "doc[-kv_idx] > 0", {}),
    ("product", "doc[q_idx * kv_idx] > 0", {}),
    ("product-of-heads", "doc[h * b] > 0", {}),
    ("flattened", "doc[b * 4 + h] > 0", {}),
    ("wrap-before-remainder", "doc[(q_idx * 2000000) % 7] > 0", {}),
    ("remainder-of-negative", "doc[(q_idx - kv_idx) % 8] > 0", {}),
    ("literal-past-end", "doc[128] > 0", {}),
    ("clamp-past-end", "doc[min(q_idx, N)] > 0", {"constants": {"N": 1000}, "extents": {"doc": 128}}),
    ("float-index", "doc[(int)1.5f] > 0", {}),
    ("unsigned", "doc[3u] > 0", {}),
    ("bitwise-or", "doc[q_idx | 1] > 0", {}),
    ("division-by-zero", "doc[q_idx / 0] > 0", {}),
    ("values-shift-negative", "doc[doc[q_idx] - 1] > 0", {}),
    ("declared-count-too-small", "doc[min(q_idx, 100)] > 0", {"extents": {"doc": 50}}),
    ("declared-axis-too-small", "doc[kv_idx] + doc[min(kv_idx + 5, 127)] > 0", {"extents": {"doc": 5}}),
    ("ternary-negative", "doc[q_idx > 0 ? 1 : -1] > 0", {}),
    ("abs-of-sum", "doc[abs(q_idx + kv_idx)] > 0", {}),
]
add("cuda-mask-index", [(case_id, lambda t=t, kw=kw: cuda_mask(t, arrays=DOC, **kw), ExpressionError)
                        for case_id, t, kw in BAD_INDICES])
BAD_EXTRAS = [
    ("constant-name-q_idx", {"constants": {"q_idx": 1}}),
    ("constant-name-keyword", {"constants": {"int": 1}}),
    ("constant-name-kName", {"constants": {"kTile": 1}}),
    ("constant-name-dunder", {"constants": {"a__b": 1}}),
    ("constant-name-_X", {"constants": {"_X": 1}}),
    ("constant-name-space", {"constants": {"a b": 1}}),
    ("constant-past-int32", {"constants": {"N": 2**31}}),
    ("constant-inf", {"constants": {"F": float("inf")}}),
    ("constant-past-float32", {"constants": {"F": 1e39}}),
    ("constant-subnormal", {"constants": {"F": 1e-40}}),
    ("constant-string", {"constants": {"S": "1"}}),
    ("constant-list", {"constants": {"S": [1]}}),
    ("constants-not-mapping", {"constants": [("N", 1)]}),
    ("array-2d", {"arrays": {"t": np.zeros((2, 2), np.int32)}}),
    ("array-empty", {"arrays": {"t": np.zeros(0, np.int32)}}),
    ("array-int64-huge", {"arrays": {"t": np.array([2**40])}}),
    ("array-float64-rounds", {"arrays": {"t": np.array([0.1])}}),
    ("array-complex", {"arrays": {"t": np.zeros(2, np.complex64)}}),
    ("array-string", {"arrays": {"t": "abc"}}),
    ("array-objects", {"arrays": {"t": np.array([object()])}}),
    ("arrays-not-mapping", {"arrays": [np.zeros(2)]}),
    ("name-clash", {"constants": {"t": 1}, "arrays": {"t": np.zeros(2, np.int32)}}),
    ("extent-unknown-array", {"extents": {"nope": 3}}),
    ("extent-axis-name", {"arrays": {"t": np.zeros(2, np.int32)}, "extents": {"t": "n"}}),
    ("extent-zero", {"arrays": {"t": np.zeros(2, np.int32)}, "extents": {"t": 0}}),
    ("extent-bool", {"arrays": {"t": np.zeros(2, np.int32)}, "extents": {"t": True}}),
    ("extents-not-mapping", {"extents": ["t"]}),
]
add("cuda-mask-extras", [(case_id, lambda kw=kw: cuda_mask("q_idx >= kv_idx", **kw), ExpressionError)
                         for case_id, kw in BAD_EXTRAS])
add("cuda-score-extras", [(case_id, lambda kw=kw: cuda_score("score", **kw), ExpressionError)
                          for case_id, kw in BAD_EXTRAS])
add("cuda-mask-extras", [("extent-past-array", lambda: cuda_mask("t[q_idx % 2] > 0", arrays={"t": np.zeros(2, np.int32)},
                                                                 extents={"t": 3}), ExpressionError, "declared extent")])
add("cuda-score-grad", [(f"{i}", lambda t=t: cuda_score("score * 2.0f", grad=t), ExpressionError)
                        for i, t in enumerate(INJECTIONS)])

# ------------------------------------------------------------------ distributed
BM1K = BlockMask.causal(1024, 1024)
PLAN2 = distributed.plan(BM1K, 2)
X1K = np.zeros((1, 1, 1024, 8), np.float16)
DIST = [
    ("plan-weights-list", lambda: distributed.plan(BM1K, 2, weights=[1, 2])),
    ("plan-weights-string", lambda: distributed.plan(BM1K, 2, weights="FULL")),
    ("plan-weights-unknown-type", lambda: distributed.plan(BM1K, 2, weights={"FOO": 1.0})),
    ("plan-weights-masked", lambda: distributed.plan(BM1K, 2, weights={"MASKED": 1.0})),
    ("plan-weights-negative", lambda: distributed.plan(BM1K, 2, weights={"FULL": -1.0})),
    ("plan-weights-nan", lambda: distributed.plan(BM1K, 2, weights={"FULL": float("nan")})),
    ("plan-mask-None", lambda: distributed.plan(None, 2)),
    ("plan-mask-array", lambda: distributed.plan(np.ones((4, 4), bool), 2)),
    ("plan-world-0", lambda: distributed.plan(BM1K, 0)),
    ("plan-world-string", lambda: distributed.plan(BM1K, "2")),
    ("plan-world-float", lambda: distributed.plan(BM1K, 2.0)),
    ("plan-strategy", lambda: distributed.plan(BM1K, 2, strategy="random")),
    ("plan-chunks-0", lambda: distributed.plan(BM1K, 2, chunks_per_rank=0)),
    ("plan-schedule", lambda: distributed.plan(BM1K, 2, schedule="tree")),
    ("plan-imbalance-0", lambda: distributed.plan(BM1K, 2, max_imbalance=0)),
    ("plan-imbalance-nan", lambda: distributed.plan(BM1K, 2, max_imbalance=float("nan"))),
    ("shard-plan-None", lambda: distributed.shard(X1K, None, 0)),
    ("shard-x-None", lambda: distributed.shard(None, PLAN2, 0)),
    ("shard-x-list", lambda: distributed.shard([1, 2], PLAN2, 0)),
    ("shard-rank-negative", lambda: distributed.shard(X1K, PLAN2, -1)),
    ("shard-rank-past", lambda: distributed.shard(X1K, PLAN2, 2)),
    ("shard-rank-string", lambda: distributed.shard(X1K, PLAN2, "0")),
    ("shard-axis-string", lambda: distributed.shard(X1K, PLAN2, 0, axis="2")),
    ("shard-axis-past", lambda: distributed.shard(X1K, PLAN2, 0, axis=7)),
    ("shard-wrong-length", lambda: distributed.shard(X1K[:, :, :512], PLAN2, 0)),
    ("unshard-plan-None", lambda: distributed.unshard(X1K, None, None)),
    ("unshard-comm-None", lambda: distributed.unshard(X1K[:, :, :512], PLAN2, None)),
    ("unshard-comm-string", lambda: distributed.unshard(X1K[:, :, :512], PLAN2, "nccl")),
    ("gather-wrong-count", lambda: distributed.gather_shards([X1K], PLAN2)),
    ("gather-string", lambda: distributed.gather_shards("ab", PLAN2)),
    ("gather-plan-None", lambda: distributed.gather_shards([X1K, X1K], None)),
    ("gather-wrong-lengths", lambda: distributed.gather_shards([X1K, X1K], PLAN2)),
    ("attention-plan-None", lambda: distributed.attention(X1K, X1K, X1K, None, None)),
    ("attention-comm-None", lambda: distributed.attention(X1K, X1K, X1K, PLAN2, None)),
    ("attention-return-lse-int", lambda: distributed.attention(X1K, X1K, X1K, PLAN2, None, return_lse=1)),
    ("backward-plan-None", lambda: distributed.attention_backward(X1K, X1K, X1K, X1K, X1K, X1K, None, None)),
    ("backward-deterministic-string", lambda: distributed.attention_backward(X1K, X1K, X1K, X1K, X1K, X1K, PLAN2,
                                                                             None, deterministic="yes")),
]
add("distributed", [(case_id, call, ArgumentError) for case_id, call in DIST])


# ------------------------------------------------------------------ the battery
@pytest.mark.parametrize("call,error,match", CASES)
def test_bad_input_gets_a_named_error_before_any_launch(call, error, match):
    with pytest.raises(OmnicupyError) as info:
        call()
    assert isinstance(info.value, error), f"{type(info.value).__name__}: {info.value}"
    if error is not NoGPUError:  # judged without a GPU: the GPU check must not come first
        assert not isinstance(info.value, NoGPUError), str(info.value)
    if match:
        assert match in str(info.value), str(info.value)


# ------------------------------------------------------------------ command line: usage errors exit 2
CLI_USAGE = [
    [], ["frobnicate"], ["--cache-dir", ""], ["--cache-dir", " ", "info"], ["precompile", "--head-dims", "7"],
    ["precompile", "--head-dims", "abc"], ["precompile", "--head-dims", ""], ["precompile", "--dtypes", "fp64"],
    ["precompile", "--stages", "5"], ["precompile", "--ops", "everything"], ["precompile", "--jobs", "0"],
    ["precompile", "--jobs", "-3"], ["precompile", "--arch", "sm_70"], ["precompile", "--arch", "bogus"],
    ["precompile", "--arch", "sm_80a"], ["precompile", "--frob"], ["cache"], ["cache", "nuke"],
    ["cache", "clear", "--older-than", "-1"], ["cache", "clear", "--older-than", "soon"],
    ["cache", "clear", "--older-than", "nan"], ["info", "--extra"], ["demo", "--head-dim", "48"],
    ["demo", "--dtype", "fp64"], ["demo", "--jobs", "0"], ["plan", "--mask", "bogus"],
    ["plan", "--mask", "sliding_window:x"], ["plan", "--mask", "local_window:1"], ["plan", "--q-len", "0"],
    ["plan", "--heads", "-1"], ["plan", "--dtype", "fp64"], ["plan", "--head-dim", "x"],
]


@pytest.mark.parametrize("argv", CLI_USAGE, ids=lambda a: "-".join(a) or "none")
def test_cli_usage_error_exits_2_with_one_line(argv, capsys, tmp_path, monkeypatch):
    from omnicupy.cli.main import main

    monkeypatch.setenv("OMNICUPY_CACHE_DIR", str(tmp_path / "cache"))
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


# ------------------------------------------------------------------ environment switches and the cache folder
ENV_BAD = [("OMNICUPY_KEEP_SOURCE", "maybe"), ("OMNICUPY_KEEP_SOURCE", "2"), ("OMNICUPY_MMA", "bogus"),
           ("OMNICUPY_MMA", "wgmma2"), ("OMNICUPY_BWD", "tma"), ("OMNICUPY_SCHEDULE", "random"),
           ("OMNICUPY_LINEINFO", "sure"), ("OMNICUPY_VERBOSE", "loud"), ("OMNICUPY_CACHE_DIR", "  ")]


@pytest.mark.parametrize("name,value", ENV_BAD, ids=lambda x: str(x))
def test_bad_environment_switch_is_a_named_error(monkeypatch, name, value):
    from omnicupy.jit import env

    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=name):
        env.check_all()


@pytest.mark.parametrize("name,value", [("OMNICUPY_MMA", "bogus"), ("OMNICUPY_SCHEDULE", "random")])
def test_bad_dispatch_switch_is_refused_by_plan(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=name):
        omnicupy.plan(Q, K, V, causal=True, arch="sm_80")


def _group_writable(parent):
    root = parent / "g"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o770)
    return root


CACHE_BAD = [
    pytest.param(lambda p: (p / "file").write_bytes(b"x") and p / "file", id="a-file"),
    pytest.param(_group_writable, id="group-writable"),
    pytest.param(lambda p: (p.joinpath("t").mkdir(), os.chmod(p / "t", 0o707), p / "t")[-1], id="other-writable"),
]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX modes")
@pytest.mark.parametrize("make", CACHE_BAD)
def test_unusable_cache_folder_is_a_cache_error(tmp_path, make):
    from omnicupy.jit.cache import DiskCache

    with pytest.raises(CacheError):
        DiskCache(make(tmp_path)).ensure_ready()


def test_the_battery_counts(capsys):
    total = len(CASES) + len(CLI_USAGE) + len(ENV_BAD) + 2 + len(CACHE_BAD)
    print(f"battery: {total} bad inputs")
    assert total >= 500
