"""A small decoder-only language model whose attention is dense or NSA, and nothing else differs.

    tokens -> embedding -> n_layers x [x + attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> lm_head

Attention, by ``ModelConfig.attention``:

  dense         q/k/v/o projections, GQA (query head h reads KV head h // G), rotary embeddings,
                then PyTorch's causal ``scaled_dot_product_attention`` (flash on the GPU)
  nsa           the project's ``nsa.NativeSparseAttention`` (same q/o projections, GQA and rotary
                layout; its own three K/V sets, phi and gates, as the paper has them)
  nsa_backbone  the same with the reach backbone (``backbone=True``; offsets sized for
                ``backbone_max_seqlen``, the longest sequence the model is evaluated on)

The dense twin rotates q and k with the layer's own rotary embedding, the library's
``nsa.rotary`` (GPT-NeoX pairs (i, i + D/2), angles in float32, positions counted from each
sequence's start).

Initialisation is the same for both twins wherever they share a parameter name and shape: each
such tensor is drawn from its own generator seeded by (seed, name), so the embedding, MLPs,
norms and the q/o projections of two arms built with one seed are bit-identical. The NSA layer's
own extras (the gate, phi) keep the layer's initialisation.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ARMS = ("dense", "nsa", "nsa_backbone")


@dataclass
class ModelConfig:
    vocab_size: int = 264
    n_layers: int = 8
    hidden: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: Optional[int] = None  # default hidden // n_heads
    mlp_hidden: Optional[int] = None  # default 8/3 hidden rounded up to a multiple of 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: str = "dense"  # one of ARMS
    # NSA (paper names): l, d, l', n, forced initial/local blocks, w; phi and K/V layout
    cmp_block_len: int = 32
    cmp_stride: int = 16
    slc_block_len: int = 64
    n_selected: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    phi: str = "mlp"
    phi_hidden: Optional[int] = None  # the mlp phi's hidden width F (the layer's default: 4 x head dim)
    shared_kv: bool = False
    gate_hidden: Optional[int] = 0  # 0: the layer's linear gate; N > 0: an MLP gate N wide; None: hidden // 4
    backbone_max_seqlen: int = 65536
    backbone_per_layer: int = 1
    save_branch_outputs: bool = False  # CUDA: ~25% faster NSA backward for 3x the output's memory

    def __post_init__(self):
        if self.attention not in ARMS:
            raise ValueError(f"attention = {self.attention!r}: must be one of {ARMS}")
        if self.head_dim is None:
            self.head_dim = self.hidden // self.n_heads
        if self.gate_hidden is None:  # a saved config that left the gate to the layer's default of
            self.gate_hidden = max(1, self.hidden // 4)  # its time, an MLP hidden // 4 wide
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.hidden / 3 / 64)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads = {self.n_heads}: must be a multiple of n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = {self.head_dim}: must be even (rotary pairs)")

    def nsa_config(self):
        import nsa

        return nsa.Config(cmp_block_len=self.cmp_block_len, cmp_stride=self.cmp_stride,
                          slc_block_len=self.slc_block_len, n_selected=self.n_selected, n_init=self.n_init,
                          n_local=self.n_local, window=self.window)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- pieces -----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """x [..., S, H, D] rotated by positions [S] with the NSA layer's own rotary embedding
    (``nsa.rotary``: GPT-NeoX pairs (i, i + D/2), angles float32(pos) * inv_freq, the rotation in
    float32 (float64 for float64 tensors), one rounding to x's dtype; differentiable)."""
    import nsa

    S, H, D = x.shape[-3:]
    if x.numel() == 0:
        return x.clone()
    flat = x.reshape(-1, H, D)
    pos = positions.to(device=x.device, dtype=torch.int32).repeat(flat.shape[0] // S)
    return nsa.rotary(flat, inv_freq.to(device=x.device, dtype=torch.float32), positions=pos).view(x.shape)


class DenseAttention(nn.Module):
    """Causal softmax attention with GQA and rotary embeddings: the NSA layer's dense twin."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x [B, S, hidden]
        B, S, _ = x.shape
        pos = torch.arange(S, device=x.device)
        q = apply_rope(self.q_proj(x).view(B, S, self.n_heads, self.head_dim), pos, self.inv_freq)
        k = apply_rope(self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim), pos, self.inv_freq)
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim)
        G = self.n_heads // self.n_kv_heads
        # [B, H, S, D]; KV head h // G serves query head h (repeat_interleave keeps that order).
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if G > 1:
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


def sparse_attention(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The project's NativeSparseAttention (under autocast it casts phi to the activations' dtype
    itself; with ``capture = True`` it keeps the selected indices, lse and gates in ``aux`` for the
    evaluation's selection statistics)."""
    import nsa

    backbone = cfg.attention == "nsa_backbone"
    return nsa.NativeSparseAttention(cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, config=cfg.nsa_config(),
                                     phi=cfg.phi, phi_hidden=cfg.phi_hidden, shared_kv=cfg.shared_kv,
                                     gate_hidden=cfg.gate_hidden, rotary=True,
                                     rope_theta=cfg.rope_theta, save_branch_outputs=cfg.save_branch_outputs,
                                     backbone=backbone, layer_idx=layer_idx if backbone else None,
                                     max_seqlen=cfg.backbone_max_seqlen if backbone else None,
                                     backbone_per_layer=cfg.backbone_per_layer)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = DenseAttention(cfg) if cfg.attention == "dense" else sparse_attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.mlp_hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


# ---- the model --------------------------------------------------------------------------------


class LM(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Normal(0, init_std) for the embedding and every projection named below (the residual
        outputs o_proj and down_proj scaled by 1/sqrt(2 n_layers)), ones for the norms; each
        tensor from a generator seeded by (seed, name), so twins agree where they share a name."""
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            leaf = name.split(".")[-2] if "." in name else name
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if leaf in ("o_proj", "down_proj"):
                std = out_std
            elif leaf in ("embed", "lm_head", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                std = self.cfg.init_std
            else:
                continue  # the NSA layer's gate and phi: the layer's own initialisation
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    def attention_layers(self) -> List[nn.Module]:
        return [b.attn for b in self.blocks]

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] -> final normed hidden states [B, S, hidden]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm_head(self.hidden_states(tokens))

    def loss(self, tokens: Tensor, weights: Optional[Tensor] = None) -> Tensor:
        """Mean next-token cross-entropy (nats) of tokens [B, S + 1]; weights [B, S] per target."""
        return self.loss_terms(tokens, weights)[0]

    def loss_terms(self, tokens: Tensor, weights: Optional[Tensor] = None,
                   answers: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """loss() and, for the targets where answers [B, S] (bool, at least one set) is set, their mean
        cross-entropy and the share predicted exactly (argmax), both detached; None without answers."""
        logits = self(tokens[:, :-1]).float()
        flat = logits.reshape(-1, logits.shape[-1])
        targets = tokens[:, 1:].reshape(-1)
        ce = F.cross_entropy(flat, targets, reduction="none")
        if weights is None:
            loss = ce.mean()
        else:
            w = weights.reshape(-1).to(ce.dtype)
            loss = (ce * w).sum() / w.sum()
        if answers is None:
            return loss, None, None
        rows = answers.reshape(-1)
        with torch.no_grad():
            answer_loss = ce[rows].mean()
            answer_acc = (flat[rows].argmax(-1) == targets[rows]).float().mean()
        return loss, answer_loss, answer_acc

    def param_counts(self) -> dict:
        total = sum(p.numel() for p in self.parameters())
        attn = sum(p.numel() for m in self.attention_layers() for p in m.parameters())
        return {"total": total, "attention": attn, "non_attention": total - attn}


def build_model(cfg: ModelConfig, seed: int = 0, device=None) -> LM:
    return LM(cfg, seed).to(device) if device is not None else LM(cfg, seed)
