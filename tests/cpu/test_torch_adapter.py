"""omnicupy.torch without a GPU: argument errors, the operators' fake (meta) implementations, the
registered autograd, the option registry, and torch.compile tracing with no graph break (on meta
tensors, where the operators run their fake implementations)."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import omnicupy  # noqa: E402
import omnicupy.torch as ot  # noqa: E402
from omnicupy import BlockMask, masks, score_mods  # noqa: E402
from omnicupy.adapters import specs  # noqa: E402

N = 256
WINDOW = BlockMask.from_mask_mod(masks.sliding_window(64), None, None, N, N)
OTHER = BlockMask.from_mask_mod(masks.sliding_window(32), None, None, N, N)


def meta(*shape, dtype=torch.float16, grad=False, bnhd=False):
    """A meta tensor [B, H, N, D]; with ``bnhd`` a transposed view of a [B, N, H, D] buffer."""
    if bnhd:
        b, h, n, d = shape
        return torch.empty(b, n, h, d, dtype=dtype, device="meta").transpose(1, 2).requires_grad_(grad)
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


Q, K = meta(2, 4, N, 64), meta(2, 2, N, 64)


@pytest.mark.parametrize("args, kwargs, match", [
    pytest.param((torch.zeros(1, 1, 64, 64, dtype=torch.float16),) * 3, {}, "CUDA tensor", id="cpu-tensor"),
    pytest.param((Q, K, "v"), {}, "v must be a torch.Tensor", id="not-a-tensor"),
    pytest.param((meta(2, 4, N, 64, dtype=torch.float32), K, K), {}, "float16 or bfloat16", id="fp32"),
    pytest.param((Q, K.to(torch.bfloat16), K), {}, "share a dtype", id="mixed-dtypes"),
    pytest.param((Q[0], K, K), {}, "4-D", id="3-d"),
    pytest.param((meta(2, 3, N, 64), K, K), {}, "multiple of kv heads", id="gqa-heads"),
    pytest.param((Q, K, meta(2, 2, N, 32)), {}, "k and v", id="kv-shapes"),
    pytest.param((Q.transpose(2, 3), K, K), {}, "contiguous in its last dim", id="last-dim-strided"),
    pytest.param((Q, K, K), {"bias": torch.zeros(2, 4, N, device="meta", requires_grad=True)}, "bias requires grad",
                 id="bias-requires-grad"),
    pytest.param((Q, K, K), {"bias": "zeros"}, "bias must be a torch.Tensor", id="bias-type"),
    pytest.param((Q, K, K, "mask"), {}, "omnicupy.BlockMask", id="mask-type"),
])
def test_bad_arguments_are_refused_before_the_operator(args, kwargs, match):
    with pytest.raises(omnicupy.ArgumentError, match=match):
        ot.attention(*args, **kwargs)


@pytest.mark.parametrize("bnhd", [False, True], ids=["bhnd", "bnhd-view"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_fake_forward_and_backward_shapes(kv_heads, dtype, bnhd):
    q = meta(2, 4, N, 64, dtype=dtype, grad=True, bnhd=bnhd)
    k, v = (meta(2, kv_heads, N, 64, dtype=dtype, grad=True, bnhd=bnhd) for _ in range(2))
    out, lse = ot.attention(q, k, v, WINDOW, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.stride() == q.stride()  # q's layout kept
    assert lse.shape == (2, 4, N) and lse.dtype == torch.float32 and not lse.requires_grad
    out.float().sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == dtype


@pytest.mark.parametrize("call, want", [
    pytest.param(lambda: ot.decode_attention(meta(2, 8, 1, 128), meta(2, 2, 1024, 128), meta(2, 2, 1024, 128),
                                             kv_lens=torch.empty(2, dtype=torch.int32, device="meta"), num_splits=4,
                                             return_lse=True), (2, 8, 1, 128), id="decode"),
    pytest.param(lambda: ot.paged_attention(meta(3, 8, 2, 64), meta(16, 32, 2, 64), meta(16, 32, 2, 64),
                                            torch.empty(3, 4, dtype=torch.int32, device="meta"),
                                            torch.empty(3, dtype=torch.int32, device="meta"), return_lse=True),
                 (3, 8, 2, 64), id="paged"),
])
def test_fake_inference_operators(call, want):
    out, lse = call()
    assert out.shape == want and lse.shape == want[:3] and lse.dtype == torch.float32


def test_inference_operators_refuse_a_backward():
    q = meta(2, 8, 1, 128, grad=True)
    out = ot.decode_attention(q, meta(2, 2, 1024, 128), meta(2, 2, 1024, 128))
    with pytest.raises(omnicupy.ArgumentError, match="no backward"):
        out.float().sum().backward()


def test_operators_are_registered_with_fake_implementations():
    for name in ("attention_fwd", "attention_bwd", "decode", "paged"):
        op = getattr(torch.ops.omnicupy, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA"), name


def test_fake_tensor_mode_gives_cuda_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 4, 128, 64, dtype=torch.float16, device="cuda")
        out = ot.attention(q, q, q, causal=True)
    assert out.device.type == "cuda" and out.shape == q.shape


@pytest.mark.parametrize("a, b, same", [
    pytest.param(dict(block_mask=WINDOW), dict(block_mask=WINDOW), True, id="same-mask"),
    pytest.param(dict(block_mask=WINDOW), dict(block_mask=OTHER), False, id="other-mask"),
    pytest.param(dict(causal=True), dict(causal=1), False, id="true-vs-1"),
    pytest.param(dict(scale=0.5), dict(scale=0.5), True, id="same-scale"),
    pytest.param(dict(score_mod=score_mods.softcap(30.0)), dict(score_mod=score_mods.softcap(30.0)), False,
                 id="modifiers-by-identity"),
])
def test_registry_keys(a, b, same):
    assert (specs.register(specs.CallSpec(**a)) == specs.register(specs.CallSpec(**b))) is same


def test_registry_refuses_unknown_keys():
    with pytest.raises(omnicupy.ArgumentError, match="no omnicupy call spec"):
        specs.lookup(10**9)


def _compiled_ops(fn, *args):
    """(graph count, graph breaks, the omnicupy operators in the forward and backward graphs)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from functorch.compile import make_boxed_func

    seen: dict[str, str] = {}

    def backend(gm, example):
        def keep(kind):
            def compiler(graph, _inputs):
                seen[kind] = str(graph.graph)
                return make_boxed_func(graph.forward)
            return compiler
        return aot_module_simplified(gm, example, fw_compiler=keep("fw"), bw_compiler=keep("bw"))

    explained = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    loss = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    loss.backward()
    return explained.graph_count, explained.graph_break_count, seen


def test_compile_traces_forward_and_backward_without_graph_break():
    class Block(torch.nn.Module):
        def forward(self, q, k):
            o = ot.attention(q, k, k, WINDOW)
            return (o.transpose(1, 2).float() ** 2).mean()

    q, k = meta(2, 4, N, 64, grad=True, bnhd=True), meta(2, 2, N, 64, grad=True, bnhd=True)
    graphs, breaks, seen = _compiled_ops(Block(), q, k)
    assert (graphs, breaks) == (1, 0)
    assert "omnicupy.attention_fwd" in seen["fw"] and "omnicupy.attention_bwd" in seen["bw"]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_compiled_graph_is_guarded_on_the_mask():
    """A new BlockMask recompiles (its key is a constant of the graph): never a stale mask."""
    keys = []

    def backend(gm, _example):
        keys.extend(n.args[-1] for n in gm.graph.nodes if "omnicupy" in str(n.target))
        return gm.forward

    f = torch.compile(lambda q, bm: ot.attention(q, q, q, bm), backend=backend, fullgraph=True)
    q = meta(1, 2, N, 64)
    f(q, WINDOW)
    f(q, OTHER)
    f(q, WINDOW)
    assert len(keys) == 2 and keys[0] != keys[1]
    assert specs.lookup(keys[0]).block_mask is WINDOW and specs.lookup(keys[1]).block_mask is OTHER


def test_torch_autograd_is_a_deprecated_alias():
    import importlib
    import sys

    sys.modules.pop("omnicupy.torch_autograd", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module("omnicupy.torch_autograd")
    assert alias.attention is ot.attention
    assert any(issubclass(w.category, DeprecationWarning) and "omnicupy.torch" in str(w.message) for w in caught)


PLAIN = (type(None), bool, int, float, str)
SOFTCAP, ALIBI = score_mods.softcap(30.0), score_mods.alibi(2)


@pytest.mark.parametrize("how", ["closure", "argument"])
@pytest.mark.parametrize("masks_, mods", [
    pytest.param([WINDOW, OTHER, WINDOW], [None] * 3, id="masks"),
    pytest.param([WINDOW] * 3, [SOFTCAP, ALIBI, SOFTCAP], id="score-mods"),
    pytest.param([None] * 3, [None, SOFTCAP, None], id="causal-and-mods"),
])
def test_dynamo_hands_the_key_function_plain_values_only(monkeypatch, how, masks_, mods):
    """torch 2.11's dynamo turns every argument of an assume_constant_result function into a Python
    constant and fails on a BlockMask or ScoreMod (later versions pass them through by identity,
    which hid that): only plain values may reach it, however the mask reaches the compiled code,
    and each new mask or modifier must give its own key."""
    seen, keys = [], []
    inner = ot._key_of_serials

    def recording(*args):
        seen.append(args)
        return inner(*args)

    monkeypatch.setattr(ot, "_key_of_serials", torch.compiler.assume_constant_result(recording))

    def backend(gm, _example):
        keys.extend(n.args[-1] for n in gm.graph.nodes if "omnicupy" in str(n.target))
        return gm.forward

    q = meta(1, 2, N, 64)
    torch._dynamo.reset()
    f = torch.compile(lambda q, bm, mod: ot.attention(q, q, q, bm, causal=bm is None, score_mod=mod),
                      backend=backend, fullgraph=True)
    for bm, mod in zip(masks_, mods):
        if how == "closure":
            g = torch.compile(lambda q: ot.attention(q, q, q, bm, causal=bm is None, score_mod=mod),
                              backend=backend, fullgraph=True)
            g(q)
        else:
            f(q, bm, mod)
    assert seen and all(type(a) in PLAIN for args in seen for a in args), seen
    want = [specs.register(specs.CallSpec(bm, bm is None, None, mod)) for bm, mod in zip(masks_, mods)]
    assert [specs.lookup(k).block_mask for k in keys] == [specs.lookup(k).block_mask for k in want[:len(keys)]]
    assert set(keys) == set(want)  # every distinct mask/modifier compiled with its own key, none stale


def test_serials_are_unique_strings_and_the_registry_is_weak():
    import gc

    from omnicupy.mask import registry

    bm = BlockMask.from_mask_mod(masks.sliding_window(16), None, None, N, N)
    serial = bm.serial
    assert type(serial) is str and serial not in (WINDOW.serial, OTHER.serial, SOFTCAP.serial)
    assert registry.find(serial, BlockMask) is bm
    with pytest.raises(omnicupy.ArgumentError, match="no live ScoreMod"):
        registry.find(serial, score_mods.ScoreMod)
    del bm
    gc.collect()
    with pytest.raises(omnicupy.ArgumentError, match="no live BlockMask"):
        registry.find(serial, BlockMask)


def test_foreign_score_mod_is_refused_before_the_operator():
    with pytest.raises(omnicupy.ArgumentError, match="score_mod must come from omnicupy.score_mods"):
        ot.attention(Q, K, K, WINDOW, score_mod=lambda s, b, h, q, k: s)
