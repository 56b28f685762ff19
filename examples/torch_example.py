"""A NativeSparseAttention layer in a small PyTorch model: train a few steps, then decode.

Runs on the CPU as written (tests/python/test_example.py runs it); pass --device cuda on a GPU.
"""
import argparse

import torch

import nsa

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
torch.manual_seed(0)

# Small blocks so that a short sequence uses every branch: l = 16, d = 8, l' = 32, n = 4, w = 64.
config = nsa.Config(cmp_block_len=16, cmp_stride=8, slc_block_len=32, n_selected=4, n_init=1, n_local=2, window=64)
layer = nsa.NativeSparseAttention(hidden_size=128, num_heads=8, num_kv_heads=2, config=config, device=args.device)
head = torch.nn.Linear(128, 128, device=args.device)
optimizer = torch.optim.AdamW(list(layer.parameters()) + list(head.parameters()), lr=1e-3)

# Two packed sequences of 200 and 120 tokens.
x = torch.randn(320, 128, device=args.device)
cu_seqlens = torch.tensor([0, 200, 320], dtype=torch.int32)
target = torch.randn(320, 128, device=args.device)
for step in range(args.steps):
    loss = torch.nn.functional.mse_loss(head(layer(x, cu_seqlens=cu_seqlens)), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

# Decoding: prefill the first 190 tokens of sequence 0, then feed the rest one token at a time.
with torch.no_grad():
    full = layer(x[:200])
    cache = nsa.NSACache()
    layer(x[:190], cache=cache)
    for t in range(190, 200):
        y = layer(x[t:t + 1], cache=cache)
    print(f"decode matches prefill: {torch.allclose(y[0], full[199], atol=1e-5)}")

# The functional API on plain tensors (or numpy arrays): shared K/V, mean-pooling compression.
q = torch.randn(100, 4, 32)
k = torch.randn(100, 2, 32)
v = torch.randn(100, 2, 32)
g = torch.rand(100, 4, 3)
o, aux = nsa.attention(q, k, v, g, config=config, return_aux=True)
print(f"o {tuple(o.shape)}, selected blocks of the last token: {aux.indices[-1, 0].tolist()}")
