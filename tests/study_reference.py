"""The study's released looped LM, restated in plain PyTorch: the independent side of
tests/unit/test_study_reference.py, which holds megaloop's study rows
(configs/experiments/study/44m/) to it weight for weight.

The study: "Dense Supervision Is Not Enough: The Readout Blind Spot in Looped Language Models"
(§3's setup: K applications of one shared stack of pre-norm RMSNorm/SwiGLU layers, H_k the
stack's output after loop k, one W_out for every exit, RMSNorm or raw readouts; §6's norm penalty
λ K⁻¹ Σ_k E‖H_k‖²_rms; Appendix G's exit-weighted objective, spectral damping and inter-loop
norm). Written from those equations and from what the released code (Rituraj003/readout-blind-
spot, commit 959dd3c) does, not copied from it:

    src/models/ar_looplm.py     AutoregressiveLoopLM.forward: the loop, the exits, the gate,
                                the inter-loop norm, spectral damping, the exit distribution
    src/models/loop_refiner.py  LoopDecoderLayer, CausalSelfAttention, SwiGLU
    src/models/refiner.py       RMSNorm (eps 1e-6, x / sqrt(mean(x²) + eps) · w)
    src/train_ar_looplm.py      the losses of supervision.mode per-step / terminal / adaptive,
                                and supervision.norm_penalty_weight

The model, batch-first ([b, t, d]) as released:

    H_0 = E[x] + P[0..t)                          (dropout on H_0: 0 here, these are tests)
    one loop: for each of the L layers
        x = x + Attn(RMSNorm_a(x))               Attn: one Linear d → 3d, viewed [b, t, 3, h, d/h]
        x = x + W2(silu(W1 n) ⊙ W3 n),  n = RMSNorm_f(x)
    after loop k (of the K the model is run at):
        H_k                                       recorded (the stack's output, nothing applied)
        logits_k = E · decode_k(H_k)              W_out tied to E
            decode_k = RMSNorm_d (one norm, every exit)      use_decode_norm
                     = identity                              raw
                     = RMSNorm_d at k = K only, else identity decode_norm_final_only
        λ_k = sigmoid(w_g · H_k + b_g)            the gate reads H_k raw
        H ← RMSNorm_loop(H_k)                     inter_loop_norm
        H ← H · sigmoid(a),  k < K                use_spectral_damping, a initialised to 2.0
    p_k = λ_k Π_{j<k}(1 − λ_j) (k < K),  p_K = Π_{j<K}(1 − λ_j)

The losses (token means; the released windows hold no padding, so its ignore_index never fires):

    terminal   CE_K
    per-step   (1/K) Σ_k CE_k
    adaptive   Σ_k mean(p_k · ce_k) − β · mean(−Σ_k p_k log max(p_k, 1e-8))
    + λ · (1/K) Σ_k mean(H_k²)                    norm_penalty_weight λ > 0

Precision, as the released code runs under CUDA bf16 autocast: Linear layers and matmuls in
bf16 (so the logits and the gate are bf16), every other op in its inputs' dtype, so the residual
stream (the embedding's fp32 plus bf16 sublayer outputs) stays fp32. The ops CUDA's autocast runs
in fp32 that see a bf16 input here are written in fp32 (CPU autocast would leave them in bf16):
the attention softmax, the cross-entropy and the entropy's log. Without autocast every line is
plain fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-6
"""src/models/refiner.py RMSNorm's default eps."""
RAW_ALPHA_INIT = 2.0
"""The damping logit's initial value (sigmoid(2.0) = 0.881), AutoregressiveLoopLM.raw_alpha."""
ENTROPY_CLAMP = 1e-8
"""p_k is clamped to this before its log in the adaptive loss's entropy."""


@dataclass(frozen=True)
class Released:
    """One study row as the released config states it (configs/44m/ar_looplm_full_*.yaml: the
    base sets inter_loop_norm false, use_decode_norm true, tied weights)."""

    supervision: str
    """supervision.mode: per-step, terminal or adaptive."""
    use_decode_norm: bool = True
    decode_norm_final_only: bool = False
    inter_loop_norm: bool = False
    use_spectral_damping: bool = False
    entropy_weight: float = 0.1
    """β of the adaptive loss (the released default, 0.1)."""
    norm_penalty_weight: float = 0.0


ROWS: dict[str, Released] = {
    "terminal_norm": Released("terminal"),
    "terminal_raw": Released("terminal", use_decode_norm=False),
    "per_loop_norm": Released("per-step"),
    "per_loop_raw": Released("per-step", use_decode_norm=False),
    "final_norm": Released("per-step", decode_norm_final_only=True),
    "terminal_norm_penalty": Released("terminal", norm_penalty_weight=0.01),
    "per_loop_norm_penalty": Released("per-step", norm_penalty_weight=0.01),
    "exit_weighted": Released("adaptive"),
    "spectral_damping": Released("per-step", use_spectral_damping=True),
    "spectral_damping_terminal": Released("terminal", use_spectral_damping=True),
    "interloop_rmsnorm": Released("per-step", inter_loop_norm=True),
}
"""Table 2's rows, by the name of megaloop's preset file, as the released setup trains them."""


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # rows: all of q, then all of k, then all of v
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)  # [b, h, t, hd]
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.float().masked_fill(future, float("-inf")).softmax(-1)
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.out_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.w1 = nn.Linear(d, ff, bias=False)  # through silu
        self.w3 = nn.Linear(d, ff, bias=False)  # the linear half
        self.w2 = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(d), Attention(d, heads)
        self.ffn_norm, self.ffn = RMSNorm(d), SwiGLU(d, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class ReleasedLoopLM(nn.Module):
    """Every parameter the released model has, under its name there. They start as NaN: what a
    test does not load stays NaN and poisons any output that reads it, except the damping logit,
    which starts where the released code starts it."""

    def __init__(
        self, row: Released, vocab: int, d: int, heads: int, layers: int, ff: int, seq: int
    ):
        super().__init__()
        self.row = row
        self.token_embedding = nn.Embedding(vocab, d)
        self.position_embedding = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(Layer(d, heads, ff) for _ in range(layers))
        self.loop_norm = RMSNorm(d)
        self.decode_norm = RMSNorm(d)
        self.exit_gate = nn.Linear(d, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(math.nan)
        self.raw_alpha = nn.Parameter(torch.tensor(RAW_ALPHA_INIT))

    def decode(self, h: torch.Tensor, k: int, num_loops: int) -> torch.Tensor:
        row = self.row
        if row.use_decode_norm and (k == num_loops or not row.decode_norm_final_only):
            h = self.decode_norm(h)
        return h @ self.token_embedding.weight.t()

    def forward(self, tokens: torch.Tensor, num_loops: int) -> dict[str, list[torch.Tensor]]:
        """tokens [b, t] → per loop k = 1..K: hidden H_k [b, t, d], logits [b, t, V], gates λ_k
        [b, t], exit probabilities p_k [b, t]."""
        t = tokens.shape[1]
        h = self.token_embedding(tokens) + self.position_embedding(torch.arange(t))
        out: dict[str, list[torch.Tensor]] = {"hidden": [], "logits": [], "gates": []}
        for k in range(1, num_loops + 1):
            for layer in self.layers:
                h = layer(h)
            out["hidden"].append(h)
            out["logits"].append(self.decode(h, k, num_loops))
            out["gates"].append(torch.sigmoid(self.exit_gate(h).squeeze(-1)))
            if self.row.inter_loop_norm:
                h = self.loop_norm(h)
            if self.row.use_spectral_damping and k < num_loops:
                h = h * torch.sigmoid(self.raw_alpha)
        out["exit_pdf"] = exit_pdf(out["gates"])
        return out


def exit_pdf(gates: list[torch.Tensor]) -> list[torch.Tensor]:
    """p_k = λ_k · (what no earlier loop took); the last loop takes what is left."""
    left, pdf = torch.ones_like(gates[0]), []
    for lam in gates[:-1]:
        pdf.append(lam * left)
        left = left * (1 - lam)
    return [*pdf, left]


def token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, t], in fp32 (CUDA autocast's cross_entropy)."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return flat.view_as(labels)


def loss(row: Released, out: dict[str, list[torch.Tensor]], labels: torch.Tensor) -> torch.Tensor:
    ce = [token_ce(z, labels) for z in out["logits"]]
    if row.supervision == "terminal":
        total = ce[-1].mean()
    elif row.supervision == "per-step":
        total = sum(c.mean() for c in ce) / len(ce)
    elif row.supervision == "adaptive":
        p = out["exit_pdf"]
        weighted = sum((p_k * c).mean() for p_k, c in zip(p, ce))
        entropy = -sum(p_k * torch.log(p_k.clamp(min=ENTROPY_CLAMP).float()) for p_k in p)
        total = weighted - row.entropy_weight * entropy.mean()
    else:
        raise ValueError(f"unknown supervision {row.supervision!r}")
    if row.norm_penalty_weight > 0:
        squares = torch.stack([h.pow(2).mean() for h in out["hidden"]])
        total = total + row.norm_penalty_weight * squares.mean()
    return total
