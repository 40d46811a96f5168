"""A small transformer block trained with ``torch.compile(model, fullgraph=True)`` and omnicupy's
attention under a packed-documents mask, checked against the same block on FlexAttention.

Two copies of one pre-norm block (GQA attention + MLP) start from the same weights and learn to
reproduce a hidden teacher block's output; one attends with ``omnicupy.torch.attention``, the
other with ``flex_attention``, both compiled with fullgraph=True (a graph break would raise).
The script prints dynamo's graph count and breaks for the omnicupy model, the first gradients'
difference, and both losses as they fall.

    python examples/train_torch_compile.py

Needs an NVIDIA GPU and torch >= 2.5 (FlexAttention); without them it says so and exits 0.
"""
from __future__ import annotations

import copy
import sys

from omnicupy import BlockMask, arrays, masks

B, N, C, H, HKV, D = 2, 2048, 256, 8, 2, 32  # batch, tokens, width, q heads, kv heads, head dim
DOCS = [700, 300, 548, 500]  # packed documents, 2048 tokens
STEPS = 20


def build(torch, attend):
    """The block's module class, attending with ``attend(q, k, v)`` on bf16 [B, H, N, D] views."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
            self.qkv = torch.nn.Linear(C, (H + 2 * HKV) * D)
            self.proj = torch.nn.Linear(H * D, C)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(C, 4 * C), torch.nn.GELU(), torch.nn.Linear(4 * C, C))
            self.attend = attend

        def forward(self, x):
            q, k, v = self.qkv(self.norm1(x)).split([H * D, HKV * D, HKV * D], dim=-1)
            q, k, v = (t.reshape(B, N, -1, D).transpose(1, 2).to(torch.bfloat16) for t in (q, k, v))
            o = self.attend(q, k, v).transpose(1, 2).reshape(B, N, H * D).float()
            x = x + self.proj(o)
            return x + self.mlp(self.norm2(x))

    return Block


def main() -> int:
    if not arrays.gpu_available():
        print("train_torch_compile.py needs an NVIDIA GPU; none is usable here, so there is nothing to train.")
        return 0
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        print("train_torch_compile.py needs torch >= 2.5 with FlexAttention: pip install 'omnicupy[torch]'")
        return 0
    if not torch.cuda.is_available():
        print("train_torch_compile.py needs a CUDA build of torch; this one has no GPU.")
        return 0
    import omnicupy.torch as ot

    doc_ids = masks.doc_ids_from_lengths(DOCS)
    omni_mask = BlockMask.from_mask_mod(masks.document(doc_ids), None, None, N, N)
    doc = torch.as_tensor(doc_ids, device="cuda")

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    flex_mask = create_block_mask(same_doc_causal, None, None, N, N, device="cuda")
    torch.manual_seed(0)
    omni_block = build(torch, lambda q, k, v: ot.attention(q, k, v, omni_mask))().cuda()
    flex_block = build(torch, lambda q, k, v: flex_attention(q, k, v, block_mask=flex_mask, enable_gqa=True))().cuda()
    flex_block.load_state_dict(omni_block.state_dict())
    teacher = copy.deepcopy(omni_block)
    for p in teacher.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(B, N, C, device="cuda")
    with torch.no_grad():
        target = teacher(x)

    explained = torch._dynamo.explain(omni_block)(x)
    print(f"dynamo on the omnicupy block: {explained.graph_count} graph(s), {explained.graph_break_count} break(s)")
    models = {"omnicupy": torch.compile(omni_block, fullgraph=True), "flex": torch.compile(flex_block, fullgraph=True)}
    blocks = {"omnicupy": omni_block, "flex": flex_block}
    optims = {name: torch.optim.AdamW(blocks[name].parameters(), lr=2e-3) for name in models}
    losses = {name: [] for name in models}
    for step in range(STEPS):
        for name, model in models.items():
            loss = torch.nn.functional.mse_loss(model(x), target)
            optims[name].zero_grad()
            loss.backward()
            losses[name].append(loss.item())
        if step == 0:
            worst = max(float(torch.linalg.norm(a.grad - b.grad) / torch.linalg.norm(b.grad))
                        for a, b in zip(omni_block.parameters(), flex_block.parameters()))
            print(f"first gradients: largest relative difference omnicupy vs flex {worst:.2e}")
        for opt in optims.values():
            opt.step()
    for step in range(0, STEPS, 4):
        print(f"step {step:3d}  loss omnicupy {losses['omnicupy'][step]:.5f}  flex {losses['flex'][step]:.5f}")
    ok = (explained.graph_break_count == 0 and worst < 3e-2 and losses["omnicupy"][-1] < losses["omnicupy"][0]
          and all(abs(a - b) <= 5e-2 * abs(b) for a, b in zip(losses["omnicupy"], losses["flex"])))
    print("matches FlexAttention" if ok else "DOES NOT MATCH FlexAttention")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
