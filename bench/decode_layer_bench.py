#!/usr/bin/env python3
"""Decode through the layer: one step of nsa.NativeSparseAttention with its paged cache against
its own pieces and against a dense twin, on the GPU, as CUDA-graph replays (and eager).

For each batch B and cache length T: the layer (hidden 4096, Hq 64, Hkv 4, D 128, bf16, phi = mlp
with F = 512, independent K/V, gates, rotary) with an NSACache of T random tokens per sequence:
  - layer step: layer(x [B, 1, hidden], cache) (projections, rotary, append, decode, o_proj);
  - projections: the same q/k/v/gate/o projections alone;
  - attention: the library's two calls alone (append + decode, torch.ops.nsa.*);
  - dense twin: the same projections with one K/V set, rotary, the new K/V written into a
    [B, Hkv, T, D] cache and SDPA decoding over it, o_proj.

    python3 bench/decode_layer_bench.py [--batch 1,8,64] [--lens 8192,32768,65536] [--markdown OUT.md]
"""
import sys

import torch
import torch.nn.functional as F

import nsa
from nsa import torch_ops
# sdpa_common: the script's folder is on sys.path
from sdpa_common import add_row, batch_lens_args, graph_ms, table_header, time_ms, write_markdown

HIDDEN, HQ, HKV, D, F_PHI = 4096, 64, 4, 128, 512



def bench(B, T):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    layer = nsa.NativeSparseAttention(HIDDEN, HQ, HKV, head_dim=D, phi="mlp", phi_hidden=F_PHI, device=dev,
                                      dtype=dt).eval()
    cache = nsa.NSACache.allocate(layer, B, T + 1024)
    for p in cache.pools:
        if p is not None:
            p.uniform_(-1, 1)
    cache.seq_lens.fill_(T)
    cache.filled = True
    x = torch.randn(B, 1, HIDDEN, device=dev, dtype=dt)
    res = {}
    with torch.no_grad():
        def layer_step():
            return layer(x, cache=cache)

        res["layer eager"] = time_ms(layer_step, warmup=2, reps=9)
        cache.seq_lens.fill_(T)
        res["layer graph"] = graph_ms(layer_step)
        cache.seq_lens.fill_(T)

        x2 = x.view(B, HIDDEN)
        o_in = torch.randn(B, HQ * D, device=dev, dtype=dt)

        def projections():
            return (layer.q_proj(x2), layer.k_proj(x2), layer.v_proj(x2), layer.gate(x2), layer.o_proj(o_in))

        res["projections graph"] = graph_ms(projections)
        q = torch.randn(B, HQ, D, device=dev, dtype=dt)
        g = torch.rand(B, HQ, 3, device=dev, dtype=dt)
        kv = [torch.randn(B, HKV, D, device=dev, dtype=dt) for _ in range(6)]
        phi_k, phi_v = layer._phi(layer.phi_k), layer._phi(layer.phi_v)
        arrays = cache.arrays()

        def attention():
            torch_ops.cache_append(arrays, kv, phi_k, phi_v, layer.config, None, 1, "auto", 0)
            return torch_ops.decode(arrays, q, g, layer.config, None, 1, False, "auto", 0)

        res["attention graph"] = graph_ms(attention)
        cache.seq_lens.fill_(T)

        # The dense twin.
        k_proj = torch.nn.Linear(HIDDEN, HKV * D, bias=False, device=dev, dtype=dt)
        v_proj = torch.nn.Linear(HIDDEN, HKV * D, bias=False, device=dev, dtype=dt)
        kc = torch.rand(B, HKV, T, D, device=dev, dtype=dt)
        vc = torch.rand(B, HKV, T, D, device=dev, dtype=dt)
        pos = torch.full((B,), T - 1, device=dev, dtype=torch.int64)

        def dense_step():
            qd = layer._rotate(layer.q_proj(x2).view(B, HQ, D), pos)
            kd = layer._rotate(k_proj(x2).view(B, HKV, D), pos)
            vd = v_proj(x2).view(B, HKV, D)
            kc[:, :, T - 1] = kd
            vc[:, :, T - 1] = vd
            o = F.scaled_dot_product_attention(qd.unsqueeze(2), kc, vc, enable_gqa=True)
            return layer.o_proj(o.reshape(B, HQ * D))

        res["dense layer eager"] = time_ms(dense_step, warmup=2, reps=9)
        res["dense layer graph"] = graph_ms(dense_step)
    del cache, kc, vc
    torch.cuda.empty_cache()
    return res


def row(B, T, r):
    """The table's row of r = bench(B, T), in microseconds."""
    lg, pr, at, dn = (r[k] * 1e3 for k in ("layer graph", "projections graph", "attention graph", "dense layer graph"))
    return (f"| {B} | {T // 1024}K | {lg:.1f} | {r['layer eager'] * 1e3:.1f} | {pr:.1f} | {at:.1f} | "
            f"{lg / (pr + at):.2f}x | {dn:.1f} | {dn / lg:.2f}x |")


def main():
    args = batch_lens_args("8192,32768,65536")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    lines = table_header("B", "T", "layer us (graph)", "layer us (eager)", "projections us",
                         "attention us (append + decode)", "layer / (proj + attn)", "dense layer us (graph)",
                         "dense / layer")
    for B in (int(b) for b in args.batch.split(",")):
        for T in (int(t) for t in args.lens.split(",")):
            add_row(lines, row(B, T, bench(B, T)))
    write_markdown(args.markdown, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
