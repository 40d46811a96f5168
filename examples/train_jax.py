"""A small attention block trained with ``jax.jit`` + ``jax.grad`` on omnicupy's attention under a
packed-documents mask, checked against ``jax.nn.dot_product_attention`` with the same explicit mask.

Two copies of one pre-norm attention block (GQA, bf16 attention, fp32 elsewhere) start from the
same parameters and learn to reproduce a hidden teacher block's output, one attending with
``omnicupy.jax.attention``, the other with XLA's attention and a dense [N, N] mask; optax's Adam
when optax is installed, else plain SGD. Prints the first gradients' difference and both losses.

    python examples/train_jax.py

Needs an NVIDIA GPU and JAX with CUDA (pip install 'omnicupy[jax]' 'jax[cuda12]'); without them it
says so and exits 0.
"""
from __future__ import annotations

import sys

from omnicupy import BlockMask, arrays, masks, reference

B, N, C, H, HKV, D = 2, 2048, 256, 8, 2, 32  # batch, tokens, width, q heads, kv heads, head dim
DOCS = [700, 300, 548, 500]
STEPS = 20


def init(jax, jnp, key, scale=0.05):
    shapes = {"wq": (C, H * D), "wk": (C, HKV * D), "wv": (C, HKV * D), "wo": (H * D, C)}
    keys = jax.random.split(key, len(shapes))
    return {name: scale * jax.random.normal(k, shape, jnp.float32) for k, (name, shape) in zip(keys, shapes.items())}


def block(jnp, attend, params, x):
    """x + Wo · attention(norm(x)); q/k/v as bf16 [B, N, heads, D] (the BNHD layout)."""
    h = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    q, k, v = ((h @ params[w]).reshape(B, N, -1, D).astype(jnp.bfloat16) for w in ("wq", "wk", "wv"))
    return x + attend(q, k, v).reshape(B, N, H * D).astype(jnp.float32) @ params["wo"]


def main() -> int:
    if not arrays.gpu_available():
        print("train_jax.py needs an NVIDIA GPU; none is usable here, so there is nothing to train.")
        return 0
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("train_jax.py needs JAX with CUDA: pip install 'omnicupy[jax]' 'jax[cuda12]'")
        return 0
    if jax.default_backend() != "gpu":
        print("train_jax.py needs JAX's CUDA backend (pip install 'jax[cuda12]' or 'jax[cuda13]'); this JAX has none.")
        return 0
    import omnicupy.jax as oj

    rule = masks.document(masks.doc_ids_from_lengths(DOCS))
    bm = BlockMask.from_mask_mod(rule, None, None, N, N)
    dense = jnp.asarray(reference.dense_mask_from_mod(rule, 1, 1, N, N))
    attends = {"omnicupy": lambda q, k, v: oj.attention(q, k, v, bm),
               "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense)}
    key_x, key_teacher, key_student = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(key_x, (B, N, C), jnp.float32)
    target = block(jnp, attends["xla"], init(jax, jnp, key_teacher), x)
    try:
        import optax

        optimizer, name = optax.adam(2e-3), "optax.adam"
    except ImportError:
        optax, optimizer, name = None, None, "plain SGD"
    print(f"optimizer: {name}")

    def make_step(attend):
        def loss(params):
            return jnp.mean((block(jnp, attend, params, x) - target) ** 2)

        @jax.jit
        def step(params, state):
            value, grads = jax.value_and_grad(loss)(params)
            if optax is None:
                return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads), state, value, grads
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value, grads

        return step

    start = init(jax, jnp, key_student)
    runs = {n: {"step": make_step(a), "params": start, "losses": []} for n, a in attends.items()}
    for run in runs.values():
        run["state"] = optimizer.init(start) if optax is not None else None
    first = {}
    for i in range(STEPS):
        for n, run in runs.items():
            run["params"], run["state"], value, grads = run["step"](run["params"], run["state"])
            run["losses"].append(float(value))
            if i == 0:
                first[n] = grads
    worst = max(float(jnp.linalg.norm(first["omnicupy"][w] - first["xla"][w]) / jnp.linalg.norm(first["xla"][w]))
                for w in first["xla"])
    print(f"first gradients: largest relative difference omnicupy vs XLA {worst:.2e}")
    for i in range(0, STEPS, 4):
        print(f"step {i:3d}  loss omnicupy {runs['omnicupy']['losses'][i]:.5f}  xla {runs['xla']['losses'][i]:.5f}")
    got, want = runs["omnicupy"]["losses"], runs["xla"]["losses"]
    ok = worst < 3e-2 and got[-1] < got[0] and all(abs(a - b) <= 5e-2 * abs(b) for a, b in zip(got, want))
    print("matches jax.nn.dot_product_attention" if ok else "DOES NOT MATCH jax.nn.dot_product_attention")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
