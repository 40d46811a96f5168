"""float64 NumPy reference attention, computed from the element-level mask (never block metadata).

    out[b,h,i] = sum_j softmax_j(scale * q[b,h,i]·k[b,hk,j] + bias | allowed(b,h,i,j)) v[b,hk,j]

Rows with no allowed key give 0 and LSE -inf (LSE = the sink logit with ``sinks=``). This is the
oracle every kernel test compares with. ``attention_backward`` gives the gradients of the same
function, from the same element-level mask: dq, dk, dv and, on request (``return_grads=``), the
gradients of the bias and of the sink logits.

- ``dense``: attention and its gradients over whole tensors (the softmax with sinks);
- ``caches``: what decode, paged and varlen calls compute, sequence by sequence;
- ``inputs``: the argument checks (as ``attention()`` checks them: named errors, never a raw NumPy
  error; any real dtype and head dim accepted).
"""
from __future__ import annotations

from .caches import decode_attention, paged_attention, varlen_attention
from .dense import DEFAULT_GRADS, GRAD_NAMES, attention, attention_backward, relative_error
from .inputs import dense_mask_from_mod

__all__ = ["attention", "attention_backward", "dense_mask_from_mod", "relative_error", "decode_attention",
           "paged_attention", "varlen_attention", "GRAD_NAMES", "DEFAULT_GRADS"]
