"""The torch autograd adapter (omnicupy/torch_autograd.py) on a GPU: gradients against the float64
reference, zero-copy and stream use, and a tiny two-layer attention model trained for a few steps
that matches the same model on FlexAttention."""
from __future__ import annotations

import copy
import sys

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

from omnicupy.torch_autograd import attention  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def new_seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def test_import_omnicupy_does_not_import_torch():
    import subprocess

    code = "import sys, omnicupy; omnicupy.attention_backward; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


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


def test_training_matches_flex_attention():
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
    for step in range(5):
        la = torch.nn.functional.mse_loss(model(x, omni_attend), target)
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
