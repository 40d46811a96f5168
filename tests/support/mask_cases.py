"""Built-in masks with parameters that make sense at small sizes, shared by the mask, builder and
attention tests.

``HOST_AS_DEVICE``: NumPy under another name, for the builders' device path on the CPU.

``MASK_CASES``: ``(id, factory)`` pairs; ``factory(q_len, kv_len)`` returns a mask_mod defined for
those lengths (masks with lookup tables get tables long enough). Use them as
``pytest.mark.parametrize("factory", [pytest.param(f, id=i) for i, f in MASK_CASES])``.
"""
from __future__ import annotations

import types

import numpy as np

from omnicupy import masks


class _HostAsDevice(types.ModuleType):
    """NumPy under another name: builders given it take their device branches (device-size chunks,
    the layout written by binary search and gathers, builds from pieces through the kernels' NumPy
    emulation, kernels.EmulatedBackend) with NumPy arrays, so that those branches run, and are
    compared with the host's, without a GPU."""

    def __getattr__(self, name):
        return getattr(np, name)


HOST_AS_DEVICE = _HostAsDevice("host_as_device")


def _cut(sizes, total: int) -> list[int]:
    """The leading ``sizes`` that reach ``total``, the last one cut short so that they sum to it."""
    ends = np.minimum(np.cumsum(sizes), total)
    ends = ends[: int(np.searchsorted(ends, total)) + 1]
    return np.diff(ends, prepend=0).tolist()


def random_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Random lengths in [low, high] summing to ``total`` (the last one may be shorter)."""
    return _cut(np.random.default_rng(seed).integers(low, high + 1, size=total // low + 1), total)


def alternating_segments(total: int, text: int, image: int) -> list[tuple[str, int]]:
    """("text", text), ("image", image), ... covering ``total`` positions (the last one cut short)."""
    sizes = _cut([text, image] * (total // min(text, image) + 1), total)
    return [("text" if i % 2 == 0 else "image", n) for i, n in enumerate(sizes)]


def _docs(q_len: int, kv_len: int, low: int = 1, high: int = 120) -> np.ndarray:
    return masks.doc_ids_from_lengths(random_lengths(max(q_len, kv_len), low, high, seed=q_len * 7919 + kv_len))


MASK_CASES = [
    ("causal", lambda q, k: masks.causal()),
    ("sliding_window_50", lambda q, k: masks.sliding_window(50)),
    ("sliding_window_1", lambda q, k: masks.sliding_window(1)),
    ("local_window_37_11", lambda q, k: masks.local_window(37, 11)),
    ("prefix_lm_100", lambda q, k: masks.prefix_lm(100)),
    ("dilated_sliding_window_8_3", lambda q, k: masks.dilated_sliding_window(8, 3)),
    ("document_causal", lambda q, k: masks.document(_docs(q, k))),
    ("document_noncausal", lambda q, k: masks.document(_docs(q, k), causal=False)),
    ("block_diagonal", lambda q, k: masks.block_diagonal(random_lengths(max(q, k), 30, 200, seed=1))),
    ("interleaved_40text_57image", lambda q, k: masks.interleaved(alternating_segments(max(q, k), 40, 57))),
    ("and_sliding_document", lambda q, k: masks.and_masks(masks.sliding_window(90), masks.document(_docs(q, k)))),
    ("or_prefix_local", lambda q, k: masks.or_masks(masks.prefix_lm(30), masks.local_window(5, 5))),
    ("not_sliding_window", lambda q, k: masks.not_mask(masks.sliding_window(20))),
]
