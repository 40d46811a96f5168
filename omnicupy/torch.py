"""omnicupy in PyTorch: differentiable attention as torch custom operators.

    import torch, omnicupy
    from omnicupy import BlockMask, masks
    import omnicupy.torch as ot

    bm = BlockMask.from_mask_mod(masks.sliding_window(256), None, None, N, N)
    out = ot.attention(q, k, v, bm)     # q [B, Hq, N, D], k/v [B, Hkv, N, D], fp16/bf16 CUDA tensors
    out.float().pow(2).mean().backward()
    model = torch.compile(model, fullgraph=True)   # no graph break at attention

The calls are ``torch.ops.omnicupy.attention_fwd / attention_bwd / decode / paged``
(adapters/torch_ops.py: fake implementations, registered autograd, outputs and workspaces from
torch's allocator on torch's current stream). The mask, score modifier and other non-tensor options
reach the operators as an integer key of a registry (adapters/specs.py); the wrappers here compute
the key with ``torch.compiler.assume_constant_result``, so dynamo bakes it into the graph as a
constant. That function takes plain values only (torch 2.11's dynamo refuses any other object
there): a BlockMask or ScoreMod goes in as its ``serial`` (omnicupy/mask/registry.py), a string
attribute that dynamo guards on, so another mask recompiles and never reuses a stale key. Needs torch >= 2.4 (custom_op,
register_fake, register_autograd); tested with 2.11 (GPU) and 2.13 (CPU).

Only this module (and omnicupy.torch_autograd, its old name) imports torch; ``import omnicupy`` never does.
"""
from __future__ import annotations

from typing import Any, Optional

from .errors import ArgumentError, MissingDependencyError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test without torch
    raise MissingDependencyError("omnicupy.torch needs PyTorch: pip install 'omnicupy[torch]' "
                                 "(with omnicupy[cuda12] or omnicupy[cuda13] for the GPU)") from exc

from .adapters import specs
from .adapters import torch_ops  # noqa: F401 - registers torch.ops.omnicupy.*
from .mask import BlockMask, registry
from .score_mods import ScoreMod

#: The oldest torch with torch.library.custom_op / register_fake / register_autograd.
MIN_TORCH = (2, 4)
DTYPES = (torch.float16, torch.bfloat16)


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


if _version(torch.__version__) < MIN_TORCH:  # pragma: no cover
    raise MissingDependencyError(f"omnicupy.torch needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found "
                                 f"{torch.__version__}: pip install -U 'omnicupy[torch]'")


@torch.compiler.assume_constant_result
def _key_of_serials(mask_serial: Optional[str], causal: Any, scale: Any, mod_serial: Optional[str], deterministic: Any,
                    fuse_mask: Any, num_splits: Any, layout: Any, window: Any, validate: Any) -> int:
    """The spec key, from plain values only: dynamo (torch 2.11) turns every argument of an
    ``assume_constant_result`` function into a Python constant, which a BlockMask or a ScoreMod
    is not; their serials (mask/registry.py) are strings, which it guards on."""
    block_mask = None if mask_serial is None else registry.find(mask_serial, BlockMask)
    score_mod = None if mod_serial is None else registry.find(mod_serial, ScoreMod)
    return specs.register(specs.CallSpec(block_mask, causal, scale, score_mod, deterministic, fuse_mask, num_splits,
                                         layout, window, validate))


def _spec_key(block_mask: Any, causal: Any, scale: Any, score_mod: Any, deterministic: Any, fuse_mask: Any,
              num_splits: Any, layout: Any, window: Any, validate: Any) -> int:
    """The key of these options (adapters/specs.py). Traced by dynamo: it reads the objects'
    ``serial`` attributes only, and refuses other objects before the key is made."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise ArgumentError(f"block_mask must be an omnicupy.BlockMask, got {type(block_mask).__name__}")
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise ArgumentError("score_mod must come from omnicupy.score_mods (alibi, softcap, cuda_score), "
                            f"got {type(score_mod).__name__}")
    return _key_of_serials(None if block_mask is None else block_mask.serial, causal, scale,
                           None if score_mod is None else score_mod.serial, deterministic, fuse_mask, num_splits,
                           layout, window, validate)


def _check_tensor(x: Any, name: str, ndim: int = 4) -> None:
    """What the wrappers check before the operator (the operator runs omnicupy's full checks);
    meta tensors pass (shape inference, FakeTensorMode)."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type not in ("cuda", "meta"):
        raise ArgumentError(f"{name} must be a CUDA tensor, got one on {x.device}")
    if x.dim() != ndim:
        raise ArgumentError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(x, name)
        if x.dtype not in DTYPES:
            raise ArgumentError(f"{name} must be float16 or bfloat16, got {x.dtype}")
        if x.stride(-1) != 1:
            raise ArgumentError(f"{name} must be contiguous in its last dim, got strides {tuple(x.stride())}")
    if not q.dtype == k.dtype == v.dtype:
        raise ArgumentError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ArgumentError(f"k and v must be [B, Hkv, Nkv, D] with q's B and D: q {tuple(q.shape)}, "
                            f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ArgumentError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) (GQA/MQA)")


def _check_bias(bias: Any) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise ArgumentError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.requires_grad:
        raise ArgumentError("bias requires grad, but omnicupy treats bias as a constant (no dbias); "
                            "pass bias.detach() to train without its gradient")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Optional[BlockMask] = None, *,
              causal: Any = False, scale: Optional[float] = None, bias: Optional[torch.Tensor] = None,
              score_mod: Any = None, deterministic: bool = False, fuse_mask: bool = False,
              return_lse: bool = False):
    """``omnicupy.attention`` on torch CUDA tensors, differentiable in q, k and v.

    q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (fp16 or bf16, last dim contiguous, other strides
    free: a ``[B, N, H, D]`` buffer's ``.transpose(1, 2)`` works without a copy, and the output keeps
    q's strides). ``block_mask`` or ``causal``, ``scale``, ``bias`` (a constant: a bias that requires
    grad is refused), ``score_mod`` (with its derivative for the backward), ``deterministic`` dQ
    and ``fuse_mask`` as in ``omnicupy.attention`` / ``attention_backward``. Returns the output, or
    ``(out, lse)`` with ``return_lse`` (the LSE gets no gradient)."""
    _check_qkv(q, k, v)
    _check_bias(bias)
    key = _spec_key(block_mask, causal, scale, score_mod, deterministic, fuse_mask, None, "NHD", None, False)
    out, lse = torch.ops.omnicupy.attention_fwd(q, k, v, bias, key)
    return (out, lse) if return_lse else out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Optional[BlockMask] = None, *,
                     kv_lens: Optional[torch.Tensor] = None, num_splits: Optional[int] = None, causal: Any = False,
                     scale: Optional[float] = None, bias: Optional[torch.Tensor] = None, score_mod: Any = None,
                     return_lse: bool = False):
    """The split-KV decode kernel (``omnicupy.attention(..., kv_lens=, num_splits=)``) as a torch
    operator: a few query rows per kv head against a contiguous KV cache; ``kv_lens`` (int32
    ``[B]`` CUDA tensor) gives each sequence its own length. Inference only (no backward)."""
    _check_qkv(q, k, v)
    _check_bias(bias)
    if kv_lens is not None:
        _check_tensor(kv_lens, "kv_lens", ndim=1)
    key = _spec_key(block_mask, causal, scale, score_mod, False, False, num_splits, "NHD", None, False)
    out, lse = torch.ops.omnicupy.decode(q, k, v, kv_lens, bias, key)
    return (out, lse) if return_lse else out


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
                    kv_lens: torch.Tensor, *, causal: bool = True, window: Optional[int] = None,
                    scale: Optional[float] = None, score_mod: Any = None, layout: str = "NHD",
                    num_splits: Optional[int] = None, validate: bool = False, return_lse: bool = False):
    """``omnicupy.paged_attention`` as a torch operator (inference only). ``validate`` defaults to
    False here: checking the page table on the device synchronizes with the host, which a
    compiled or CUDA-graph-captured model must not do (the kernel still never reads outside the
    cache; ``omnicupy.ops.decode.take_device_errors()`` reports bad entries)."""
    _check_tensor(q, "q")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        _check_tensor(x, name)
    _check_tensor(page_table, "page_table", ndim=2)
    _check_tensor(kv_lens, "kv_lens", ndim=1)
    key = _spec_key(None, causal, scale, score_mod, False, False, num_splits, layout, window, validate)
    out, lse = torch.ops.omnicupy.paged(q, k_pages, v_pages, page_table, kv_lens, key)
    return (out, lse) if return_lse else out


__all__ = ["MIN_TORCH", "attention", "decode_attention", "paged_attention"]
