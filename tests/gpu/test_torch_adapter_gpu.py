"""omnicupy.torch on a GPU: gradients against the float64 reference, torch's stream and allocator,
torch.compile(fullgraph=True) with no graph break, CUDA graphs (mode="reduce-overhead"), the decode
and paged operators against omnicupy's own calls, and a tiny two-layer attention model trained for a
few steps (eager and compiled) that matches the same model on FlexAttention."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import omnicupy
from omnicupy import BlockMask, masks, reference

from helpers import TOLERANCE

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("torch without CUDA", allow_module_level=True)

import omnicupy.torch as ot  # noqa: E402
from omnicupy.torch import attention  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def new_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("mask_kind", ["causal", "document", "gqa-window"])
def test_gradients_match_reference(mask_kind, layout, dtype):
    seed = new_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, Hq, N, D = 2, 4, 333, 64
    Hkv = 2 if mask_kind == "gqa-window" else Hq

    def tensor(h):
        shape = (B, h, N, D) if layout == "bhnd" else (B, N, h, D)
        x = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPES[dtype])
        x = x if layout == "bhnd" else x.transpose(1, 2)  # a strided [B, H, N, D] view
        return x.requires_grad_()

    q, k, v = tensor(Hq), tensor(Hkv), tensor(Hkv)
    bm, causal = None, False
    if mask_kind == "causal":
        causal, rule = True, masks.causal()
    elif mask_kind == "document":
        rule = masks.document(masks.doc_ids_from_lengths([100, 33, 150, 50]))
        bm = BlockMask.from_mask_mod(rule, None, None, N, N, q_block_size=64, kv_block_size=64)
    else:
        rule = masks.sliding_window(70)
        bm = BlockMask.from_mask_mod(rule, None, None, N, N)
    out = attention(q, k, v, bm, causal=causal)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.shape == q.shape
    g = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    (out.float() * g.float()).sum().backward()
    host = [x.detach().float().cpu().numpy().astype(np.float64) for x in (q, k, v, g)]
    dense = reference.dense_mask_from_mod(rule, 1, 1, N, N)
    want = reference.attention_backward(host[3], *host[:3], dense)
    for name, t, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert t is not None and t.dtype == q.dtype
        err = reference.relative_error(t.float().cpu().numpy(), w)
        assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e} (seed {seed})"


def test_runs_on_torchs_current_stream():
    """Work queued on a side stream is ordered with torch's kernels there, with no synchronization."""
    seed = new_seed()
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q2 = q * 2  # produced on the side stream, consumed there by omnicupy
        out = attention(q2, k, v, causal=True)
        out.sum().backward()
    torch.cuda.synchronize()
    want = omnicupy.attention(cp.from_dlpack(q2.detach()), cp.from_dlpack(k.detach()), cp.from_dlpack(v.detach()),
                              causal=True)
    torch.testing.assert_close(out.detach(), torch.from_dlpack(want), rtol=0, atol=0, msg=f"seed {seed}")
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_bias_with_grad_is_refused():
    q = torch.zeros(1, 1, 64, 64, device="cuda", dtype=torch.float16)
    bias = torch.zeros(1, 1, 64, device="cuda", requires_grad=True)
    with pytest.raises(omnicupy.ArgumentError, match="bias"):
        attention(q, q, q, bias=bias)


# ---------------------------------------------------------------- training against FlexAttention
class TinyAttentionModel(torch.nn.Module):
    """Two pre-norm attention layers with residuals; attention is a pluggable function of bf16
    [B, H, N, D] tensors (omnicupy or flex), everything else fp32."""

    def __init__(self, dim=128, heads=4, kv_heads=2, head_dim=32):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = (heads + 2 * kv_heads) * head_dim
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(2))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, width) for _ in range(2))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(heads * head_dim, dim) for _ in range(2))

    def forward(self, x, attend):
        B, N, _ = x.shape
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        for norm, qkv, proj in zip(self.norms, self.qkv, self.proj):
            q, k, v = qkv(norm(x)).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = (t.reshape(B, N, -1, D).transpose(1, 2).to(torch.bfloat16) for t in (q, k, v))
            o = attend(q, k, v)
            x = x + proj(o.transpose(1, 2).reshape(B, N, H * D).float())
        return x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-fullgraph"])
def test_training_matches_flex_attention(compiled):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seed = new_seed()
    torch.manual_seed(seed)
    B, N, dim = 2, 384, 128
    lengths = [100, 60, 124, 100]
    doc_np = masks.doc_ids_from_lengths(lengths)
    doc = torch.as_tensor(doc_np, device="cuda")

    def flex_rule(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    flex_bm = create_block_mask(flex_rule, None, None, N, N, device="cuda")
    omni_bm = BlockMask.from_mask_mod(masks.document(doc_np), None, None, N, N)

    def omni_attend(q, k, v):
        return attention(q, k, v, omni_bm)

    def flex_attend(q, k, v):
        return flex_attention(q, k, v, block_mask=flex_bm, enable_gqa=True)

    model = TinyAttentionModel(dim).cuda()
    twin = copy.deepcopy(model)
    opt_a = torch.optim.Adam(model.parameters(), lr=3e-3)
    opt_b = torch.optim.Adam(twin.parameters(), lr=3e-3)
    x = torch.randn(B, N, dim, device="cuda")
    target = torch.randn(B, N, dim, device="cuda")
    losses = []
    run = torch.compile(model, fullgraph=True) if compiled else model
    for step in range(5):
        la = torch.nn.functional.mse_loss(run(x, omni_attend), target)
        lb = torch.nn.functional.mse_loss(twin(x, flex_attend), target)
        opt_a.zero_grad()
        opt_b.zero_grad()
        la.backward()
        lb.backward()
        if step == 0:  # the first gradients, before the two models drift apart by rounding
            for (name, pa), pb in zip(model.named_parameters(), twin.parameters()):
                err = float(torch.linalg.norm(pa.grad - pb.grad) / torch.linalg.norm(pb.grad))
                assert err < 3e-2, f"{name}: gradient differs from flex by {err:.2e} (seed {seed})"
        opt_a.step()
        opt_b.step()
        losses.append((la.item(), lb.item()))
    print(f"losses omnicupy vs flex (seed {seed}): {losses}")
    for a, b in losses:
        assert abs(a - b) <= 1e-2 * abs(b), f"loss {a} vs flex {b} (seed {seed})"
    assert losses[-1][0] < losses[0][0], "training did not lower the loss"


# ---------------------------------------------------------------- torch.compile and CUDA graphs
def _inputs(seed, B=2, Hq=4, Hkv=2, N=512, D=64, dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, N, Hq, D, generator=gen, device="cuda", dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, N, Hkv, D, generator=gen, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


DOC_MASK = BlockMask.from_mask_mod(masks.document(masks.doc_ids_from_lengths([200, 100, 212])), None, None, 512, 512)


def _loss(q, k, v, bm):
    return (attention(q, k, v, bm).float() ** 2).mean()


def _step(loss_fn, q, k, v, bm):
    """Forward and backward of ``loss_fn`` (eager or compiled): (loss, dq, dk, dv), cloned (a CUDA
    graph's outputs are overwritten by its next replay)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    loss = loss_fn(q, k, v, bm)
    loss.backward()
    return tuple(x.detach().clone() for x in (loss, q.grad, k.grad, v.grad))


def test_dynamo_sees_no_graph_break_on_cuda():
    q, k, v = _inputs(new_seed())
    explained = torch._dynamo.explain(lambda q, k, v: attention(q, k, v, DOC_MASK).float().sum())(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "cuda-graphs"])
def test_compiled_step_equals_eager(mode):
    """The compiled step (inductor; with mode="reduce-overhead" replayed from a CUDA graph) gives the
    eager step's loss and gradients: same kernels, so equal up to dQ's atomic-add order."""
    seed = new_seed()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(_loss, fullgraph=True, mode=mode)
    q, k, v = _inputs(seed)
    want = _step(_loss, q, k, v, DOC_MASK)
    for _ in range(4):  # warm-up, record, replays
        got = _step(compiled, q, k, v, DOC_MASK)
    torch.cuda.synchronize()
    for name, a, b in zip(("loss", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=f"{name} (seed {seed})")
    if mode == "reduce-overhead":
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


WINDOW_MASK = BlockMask.from_mask_mod(masks.sliding_window(100), None, None, 512, 512)


def test_compiled_step_follows_the_mask_and_modifier_it_is_given():
    """Masks and score modifiers passed as arguments of one compiled function (fullgraph): each
    call gives the eager result for the objects of that call (dynamo guards on their serials and
    recompiles), never a stale key, including after switching back."""
    seed = new_seed()
    torch._dynamo.reset()
    soft = omnicupy.score_mods.softcap(20.0)

    def loss(q, k, v, bm, mod):
        return (attention(q, k, v, bm, score_mod=mod).float() ** 2).mean()

    compiled = torch.compile(loss, fullgraph=True)
    q, k, v = _inputs(seed)
    for bm, mod in ((DOC_MASK, None), (WINDOW_MASK, None), (DOC_MASK, soft), (DOC_MASK, None)):
        want = _step(lambda q, k, v, bm: loss(q, k, v, bm, mod), q, k, v, bm)
        got = _step(lambda q, k, v, bm: compiled(q, k, v, bm, mod), q, k, v, bm)
        for name, a, b in zip(("loss", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=f"{name}, {bm.serial}, {mod} (seed {seed})")


def test_operators_allocate_from_torch_only():
    """After a signature's first call (which fills omnicupy's caches from CuPy's pool), a forward
    and backward take no memory from CuPy's allocator: outputs, workspaces and omnicupy's own LSE
    all come from torch's caching allocator (CuPy's is made to refuse here)."""
    def refuse(size):
        raise AssertionError(f"CuPy allocated {size} bytes outside torch's allocator")

    q, k, v = _inputs(new_seed())
    bm = BlockMask.from_mask_mod(masks.sliding_window(100), None, None, 512, 512)
    _step(_loss, q, k, v, bm)  # the first call of this signature
    with cp.cuda.using_allocator(refuse):
        for _ in range(2):
            _step(_loss, q, k, v, bm)
    torch.cuda.synchronize()


def test_decode_operator_matches_omnicupy():
    seed = new_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(3, 8, 1, 128, generator=gen, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(3, 2, 2048, 128, generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.tensor([2048, 700, 1], device="cuda", dtype=torch.int32)
    got, lse = ot.decode_attention(q, k, v, kv_lens=lens, num_splits=4, return_lse=True)
    want, want_lse = omnicupy.attention(*(cp.from_dlpack(x) for x in (q, k, v)), kv_lens=cp.from_dlpack(lens),
                                        num_splits=4, return_lse=True)
    torch.testing.assert_close(got, torch.from_dlpack(want), rtol=1e-3, atol=1e-3, msg=f"seed {seed}")
    torch.testing.assert_close(lse, torch.from_dlpack(want_lse), rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_paged_operator_matches_omnicupy():
    seed = new_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages, page_size, B = 32, 64, 3
    q = torch.randn(B, 8, 2, 128, generator=gen, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(pages, page_size, 2, 128, generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)[:B * 8].reshape(B, 8)
    lens = torch.tensor([512, 100, 3], device="cuda", dtype=torch.int32)
    got = torch.compile(ot.paged_attention, fullgraph=True)(q, k, v, table, lens)
    want = omnicupy.paged_attention(*(cp.from_dlpack(x) for x in (q, k, v, table, lens)))
    torch.testing.assert_close(got, torch.from_dlpack(want), rtol=1e-3, atol=1e-3, msg=f"seed {seed}")


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_opcheck(layout):
    """torch.library.opcheck: schema, fake against real outputs (shapes, strides, dtypes), autograd
    registration, AOT dispatch. Deterministic dQ: opcheck compares two runs' gradients."""
    from omnicupy.adapters import specs

    q, k, v = _inputs(new_seed(), N=256)
    if layout == "bhnd":
        q, k, v = (x.contiguous() for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    key = specs.register(specs.CallSpec(None, True, None, None, True, False))
    torch.library.opcheck(torch.ops.omnicupy.attention_fwd.default, (q, k, v, None, key))


@pytest.mark.parametrize("extra", ["softcap", "bias", "deterministic"])
def test_options_reach_both_operators(extra):
    """A score modifier, a constant bias and deterministic dQ reach the forward and backward
    operators through the option registry: the op's results equal omnicupy's own calls."""
    seed = new_seed()
    q, k, v = _inputs(seed)
    dout = torch.randn_like(q)
    kwargs = {"softcap": {"score_mod": omnicupy.score_mods.softcap(20.0)},
              "bias": {"bias": torch.randn(2, 4, 512, device="cuda", dtype=torch.float32)},
              "deterministic": {"deterministic": True}}[extra]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = attention(qg, kg, vg, DOC_MASK, **kwargs)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    own = {name: cp.from_dlpack(value) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    c = [cp.from_dlpack(x) for x in (q, k, v, dout)]
    det = own.pop("deterministic", False)
    want_out, lse = omnicupy.attention(*c[:3], DOC_MASK, return_lse=True, **own)
    want = omnicupy.attention_backward(c[3], *c[:3], want_out, lse, DOC_MASK, deterministic=det, **own)
    torch.testing.assert_close(out, torch.from_dlpack(want_out), rtol=1e-3, atol=1e-3, msg=f"out (seed {seed})")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        torch.testing.assert_close(g, torch.from_dlpack(w), rtol=2e-3, atol=2e-3, msg=f"{name} (seed {seed})")
