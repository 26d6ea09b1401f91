"""Benchmark models and data: a GPT-style decoder (optionally with LoRA adapters) and a small CNN.

Every trainable layer is one the per-example engine covers (``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm``, ``nn.Conv2d``, ``nn.GroupNorm``) and every layer input keeps the batch first, so the
same model runs unchanged under our engine, Opacus (hooks and ghost), ``torch.func`` and a per-example
loop. Attention is written with ``nn.Linear`` q/k/v/o projections, not ``nn.MultiheadAttention``.

Also here: the shapes of the model's Linear-like layers and the *arithmetic floor* of DP over non-DP,
``1 + min(T(d+p), d·p) / (3·d·p)`` per Linear, aggregated over the model weighted by FLOPs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

GPT_DEFAULTS = dict(vocab=256, d_model=256, heads=4, layers=4, seq=128, lora_rank=0, kv_heads=0, llama=False, ffn=0)
CNN_DEFAULTS = dict(channels=32, image=32, classes=10)


class LoRALinear(nn.Module):
    """A frozen base ``nn.Linear`` plus a trainable low-rank update ``up(down(x)) · alpha/r``.

    ``down`` (d→r) and ``up`` (r→p) are plain ``nn.Linear`` layers without bias, so the per-example
    engine clips them like any Linear; ``up`` starts at zero (the usual LoRA initialisation).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: Optional[float] = None):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)
        self.scale = (alpha if alpha is not None else 2.0 * rank) / rank

    def forward(self, x):
        return self.base(x) + self.up(self.down(x)) * self.scale


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention (q/k/v/o Linears) and a 4× GELU MLP.

    ``llama=True``: the Llama layout instead: RMSNorm, Linears without bias, a SwiGLU MLP of width ``ffn``
    (``fc2(silu(gate(x)) · fc1(x))``); ``kv_heads`` < ``heads``: grouped-query attention (k and v project to
    ``kv_heads`` heads, each shared by ``heads / kv_heads`` query heads)."""

    def __init__(self, d: int, heads: int, kv_heads: int = 0, llama: bool = False, ffn: int = 0):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        kv, bias, f = self.kv_heads * (d // heads), not llama, ffn or 4 * d
        norm = nn.RMSNorm if llama else nn.LayerNorm
        self.ln1 = norm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, n, bias=bias) for n in (d, kv, kv, d))
        self.ln2 = norm(d)
        self.gate = nn.Linear(d, f, bias=False) if llama else None
        self.fc1 = nn.Linear(d, f, bias=bias)
        self.fc2 = nn.Linear(f, d, bias=bias)

    def attention(self, x):
        B, T, d = x.shape
        h = self.heads

        def split(t, n):
            return t.view(B, T, n, d // h).transpose(1, 2)

        k, v = split(self.k(x), self.kv_heads), split(self.v(x), self.kv_heads)
        if self.kv_heads != h:  # each k/v head serves h / kv_heads query heads
            k, v = (t.repeat_interleave(h // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(split(self.q(x), h), k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        h = self.ln2(x)
        if self.gate is not None:
            return x + self.fc2(F.silu(self.gate(h)) * self.fc1(h))
        return x + self.fc2(F.gelu(self.fc1(h)))


class GPT(nn.Module):
    """Token + learned position embedding, ``layers`` decoder blocks, final LayerNorm, vocabulary head.

    Position ids are materialised per example (``arange(T).repeat(B, 1)``): every layer input has the
    batch first, as per-example clipping requires, and Opacus' ghost mode accepts it (it fails on the
    non-contiguous ``expand`` view).
    """

    def __init__(self, vocab=256, d_model=256, heads=4, layers=4, seq=128, lora_rank=0, kv_heads=0, llama=False,
                 ffn=0):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)  # learned positions also for llama=True (RoPE has no parameter)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads, llama, ffn) for _ in range(layers))
        self.ln_f = nn.RMSNorm(d_model) if llama else nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=not llama)
        if lora_rank:
            apply_lora(self, lora_rank)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).repeat(B, 1)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def apply_lora(model: GPT, rank: int) -> GPT:
    """Freeze every parameter, then put trainable rank-``rank`` adapters on each block's q and v."""
    for p in model.parameters():
        p.requires_grad_(False)
    for blk in model.blocks:
        blk.q = LoRALinear(blk.q, rank)
        blk.v = LoRALinear(blk.v, rank)
    return model


class CNN(nn.Module):
    """Three Conv2d + GroupNorm + ReLU stages (32×32 → 8×8) and a Linear classifier."""

    def __init__(self, channels=32, image=32, classes=10):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(8, c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.ReLU(),
        )
        self.fc = nn.Linear(2 * c * (image // 4) ** 2, classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def build_model(kind: str, **kw) -> nn.Module:
    """``kind`` is ``"gpt"`` or ``"cnn"``; ``kw`` overrides the defaults (unknown keys are ignored)."""
    if kind == "gpt":
        return GPT(**{k: kw.get(k, v) for k, v in GPT_DEFAULTS.items()})
    if kind == "cnn":
        return CNN(**{k: kw.get(k, v) for k, v in CNN_DEFAULTS.items()})
    raise ValueError(f"unknown model {kind!r}")


def make_data(kind: str, n: int, seed: int = 0, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random examples: token sequences with next-token targets, or images with labels."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        V, T = kw.get("vocab", GPT_DEFAULTS["vocab"]), kw.get("seq", GPT_DEFAULTS["seq"])
        toks = torch.randint(0, V, (n, T + 1), generator=g)
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    s, k = kw.get("image", CNN_DEFAULTS["image"]), kw.get("classes", CNN_DEFAULTS["classes"])
    return torch.randn(n, 3, s, s, generator=g), torch.randint(0, k, (n,), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of per-example losses (a sequence's loss is the mean over its tokens)."""
    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def param_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


# --------------------------------------------------------------------------------------- arithmetic floor
def linear_shapes(model: nn.Module, x: torch.Tensor) -> list[dict]:
    """(name, T, d, p, trainable) of every Linear and Conv2d call in one forward on ``x`` (batch first).

    A Conv2d is the Linear over its unfolded patches: T = H_out·W_out, d = C_in·k_h·k_w, p = C_out.
    """
    rows, handles = [], []
    names = {m: n for n, m in model.named_modules()}

    def hook(mod, inp, out):
        trainable = mod.weight.requires_grad
        if isinstance(mod, nn.Conv2d):
            T = out.shape[2] * out.shape[3]
            d = mod.in_channels * math.prod(mod.kernel_size) // mod.groups
            p = mod.out_channels
        else:
            T = math.prod(inp[0].shape[1:-1])
            d, p = mod.in_features, mod.out_features
        rows.append(dict(name=names[mod], T=int(T), d=int(d), p=int(p), trainable=bool(trainable)))

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for h in handles:
            h.remove()
    return rows


def layer_floor(T: int, d: int, p: int) -> float:
    """``1 + min(T(d+p), d·p) / (3·d·p)``: the per-example norm (ghost ``T²(d+p)`` or instantiated
    ``T·d·p`` multiply-adds per example, the cheaper) over the layer's non-DP forward + backward
    (``3·T·d·p``: output, input gradient, weight gradient). The clipped sum itself replaces the weight
    gradient at the same cost, so it adds nothing."""
    return 1.0 + min(T * (d + p), d * p) / (3.0 * d * p)


def model_floor(shapes: list[dict]) -> float:
    """FLOP-weighted floor over the model's Linear-like layers: ``Σ(base + extra) / Σ base``.

    A trainable layer's non-DP cost is ``3·T·d·p`` and DP adds ``min(T(d+p), d·p)·T``; a frozen layer
    (LoRA's base weights) costs ``2·T·d·p`` (no weight gradient) and DP adds nothing to it.
    """
    base = extra = 0.0
    for s in shapes:
        T, d, p = s["T"], s["d"], s["p"]
        if s["trainable"]:
            base += 3.0 * T * d * p
            extra += T * min(T * (d + p), d * p)
        else:
            base += 2.0 * T * d * p
    return (base + extra) / base if base else 1.0


def zero_model_states(psi: int, world: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
                      optim_bytes: int = 12) -> int:
    """ZeRO paper's model-state bytes per rank (Rajbhandari et al. 2020, Fig. 1) for Ψ parameters on N_d
    ranks: stage 0 ``(P+G+K)Ψ``; 1 ``(P+G)Ψ + KΨ/N_d``; 2 ``PΨ + (G+K)Ψ/N_d``; 3 ``(P+G+K)Ψ/N_d``.
    Mixed-precision Adam: P = G = 2, K = 12 (fp32 master, momentum, variance); fp32 training with
    DeepSpeed's separate fp32 partition: P = G = 4, K = 12."""
    P, G, K, N = param_bytes * psi, grad_bytes * psi, optim_bytes * psi, world
    return int({0: P + G + K, 1: P + G + K / N, 2: P + (G + K) / N, 3: (P + G + K) / N}[stage])
