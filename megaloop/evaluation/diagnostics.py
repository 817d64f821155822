"""Why hidden norms drift: the readout hides scale, the recurrence carries it (the study's
Tables 3, 4 and 6, Figures 3 and 6, Appendix D). Formulas: docs/diagnostics.md.

On a held-out slice, at the trained depth K:
  scale      token-level ‖H_k‖_rms at every loop: mean and p50/p90/p99/p99.9/max (and as L2
             norms, √d·RMS), and the quantiles of its distribution
  radial     r_k = mean over tokens of ⟨g, u⟩²/‖g‖², g = ∇_{H_k} L_k, u = H_k/‖H_k‖; and the
             signed g_K = ∂L_K/∂log‖H_K‖ (the whole slice's H_K scaled together)
  rollout    loops 1..R (R = 30): s_k, the radial increment a_rad,k = ⟨u_k, b_k⟩/d with
             u_k = H_k/‖H_k‖_rms and b_k = F(H_k) − H_k, ‖b_k‖_rms, the angle between H_k and
             H_{k+1}, and CE at every exit
  sweep      CE of the final readout of c·H_K, c on a log grid 0.01..100
  clamp      every loop held at its loop-1 RMS: norm ratio and ΔCE at K against no clamp
  label path (models with the exit gate) Ouro's training objective: CE of the exit-weighted
             mixture of logits Σ_k p_k·logits_k over k = 1..K, with that mixture's mean
             softmax entropy and top-1 minus top-2 logit margin (the study's Table 6)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from megaloop.evaluation import harness
from megaloop.evaluation.settings import DiagnoseSettings
from megaloop.model import semantics

PERCENTILES = (50, 90, 99, 99.9)
SCALES = np.logspace(-2, 2, 17)


def rms(h: torch.Tensor) -> torch.Tensor:
    """Per-token ‖H‖_rms in float64, [b, s]."""
    return semantics.rms(h, torch.float64)


def radial_terms(
    model, h: torch.Tensor, loop: int, last: int, targets: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Per-token radial share ⟨g, u⟩²/‖g‖² of exit `loop`'s CE gradient in a run of `last`
    loops, and Σ_t ⟨g_t, H_t⟩ (with the CE summed over tokens, so each token's gradient is its
    own CE's)."""
    h = h.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = harness.token_ce(model.readout(h, loop, last), targets).sum()
        (grad,) = torch.autograd.grad(loss, h)
    g, x = grad.double(), h.detach().double()
    inner = (g * x).sum(-1)
    share = inner.pow(2) / (g.pow(2).sum(-1) * x.pow(2).sum(-1)).clamp_min(1e-300)
    return share, inner.sum().item()


def mix_exit(
    mixed: torch.Tensor | None,
    survival: semantics.Survival,
    logits: torch.Tensor,
    lam: torch.Tensor,
    last: bool,
) -> torch.Tensor:
    """The mixture Σ_k p_k·logits_k so far, with this loop's share added (float64); lam [b, s]."""
    term = survival.step(lam.double(), last)[..., None] * logits.double()
    return term if mixed is None else mixed + term


def logit_statistics(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    """Sums over tokens of CE, softmax entropy and the top-1 minus top-2 logit margin."""
    logp = logits.double().log_softmax(-1)
    top2 = logits.double().topk(2, dim=-1).values
    return np.array(
        [
            -logp.gather(-1, targets[..., None]).sum().item(),
            -(logp.exp() * logp).sum().item(),
            (top2[..., 0] - top2[..., 1]).sum().item(),
        ]
    )


def run(settings: DiagnoseSettings) -> dict:
    """`settings.dtype` is the precision the model runs and the radial gradient is taken in: in
    float32 a normalising readout's r_k is the (ε/mean square)² floor, which falls as the state
    grows; in bfloat16 rounding sets a floor near 1e-8 at any scale (the study's precision). See
    docs/diagnostics.md."""
    harness.check_data(settings.data)
    device, dtype = harness.device_and_dtype(settings.dtype, settings.device)
    opened = harness.open_model(settings.model, device, dtype)
    settings = opened.fitted(settings)
    sequences = max(1, math.ceil(settings.tokens / settings.seq_len))
    tokens = harness.read_tokens(settings.data, opened.encode)
    tally = Tally(opened.model, opened.trained_loops, settings.rollout)
    with torch.no_grad():
        for batch in harness.batches(
            harness.windows(tokens, settings.seq_len, sequences), settings.batch_size, "diagnose"
        ):
            batch = batch.to(device)
            tally.free_run(batch[:, :-1], batch[:, 1:])
            tally.clamped_run(batch[:, :-1], batch[:, 1:])
    d = opened.model.config.hidden_size
    result = {
        "model": opened.info,
        "settings": settings.record(
            device=device,
            dtype=dtype,
            tokens=tally.count,
            sequences=sequences,
            hidden_size=d,
            num_loops_trained=opened.trained_loops,
        ),
        **tally.result(d),
    }
    if settings.out is not None:
        harness.write(settings.out, "diagnose", result, markdown(result))
    return result


class Tally:
    """The sums `diagnose` reports, over the batches: per-loop scale and CE beyond K (the
    rollout), the radial terms and the scale sweep at the exits, and the clamped run."""

    def __init__(self, model, trained_loops: int, rollout: int):
        self.model, self.K = model, trained_loops
        self.deepest = max(rollout, trained_loops)
        self.token_rms = [[] for _ in range(self.deepest)]
        self.shares = [[] for _ in range(trained_loops)]
        self.signed_g, self.count = 0.0, 0
        self.ce = np.zeros(self.deepest)
        self.sweep = np.zeros(len(SCALES))
        self.roll = {
            key: np.zeros(self.deepest - 1)
            for key in ("a_rad", "update_rms", "angle_deg", "scale_step")
        }
        self.clamped_ce, self.clamped_rms, self.clamp_drift = 0.0, [], 0.0
        self.gated = bool(getattr(model.config, "exit_gate", False))
        self.label_path = np.zeros(3)

    def free_run(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        model, K = self.model, self.K
        previous, mixed, survival = None, None, semantics.Survival()
        for k, h in harness.trajectory(model, inputs, self.deepest):
            self.token_rms[k - 1].append(rms(h).flatten().cpu())
            # the rollout's CE at k is a k-loop run's (as `depth` reads it); the exits up to K
            # are read as in the trained K-loop run
            ce = harness.token_ce(model.readout(h, k, k), targets)
            self.ce[k - 1] += ce.double().sum().item()
            if self.gated and k <= K:
                lam = model.exit_probability(h)[..., 0]
                logits = model.readout(h, k, K)
                mixed = mix_exit(mixed, survival, logits, lam, last=k == K)
            if k <= K:
                share, inner = radial_terms(model, h, k, K, targets)
                self.shares[k - 1].append(share.flatten().cpu())
            if k == K:
                self.signed_g += inner
                for i, c in enumerate(SCALES):
                    ce = harness.token_ce(model.readout(c * h, k, K), targets)
                    self.sweep[i] += ce.double().sum().item()
            if previous is not None:
                self.rollout_step(k, previous, h)
            previous = h
        if self.gated:
            self.label_path += logit_statistics(mixed, targets)
        self.count += targets.numel()

    def rollout_step(self, k: int, previous: torch.Tensor, h: torch.Tensor) -> None:
        """Loop k's update of H_{k-1}: its radial part, size, angle and scale change."""
        x, b = previous.double(), h.double() - previous.double()
        u = x / rms(previous)[..., None]
        cos = (x * h.double()).sum(-1) / (x.norm(dim=-1) * h.double().norm(dim=-1))
        self.roll["a_rad"][k - 2] += ((u * b).sum(-1) / x.shape[-1]).sum().item()
        self.roll["update_rms"][k - 2] += rms(b).sum().item()
        self.roll["angle_deg"][k - 2] += torch.rad2deg(torch.arccos(cos.clamp(-1, 1))).sum().item()
        self.roll["scale_step"][k - 2] += (rms(h) - rms(previous)).sum().item()

    def clamped_run(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        loop1 = None
        for k, h in harness.trajectory(self.model, inputs, self.K, clamp=True):
            loop1 = rms(h) if loop1 is None else loop1
            self.clamp_drift = max(self.clamp_drift, ((rms(h) / loop1) - 1).abs().max().item())
            if k == self.K:
                ce = harness.token_ce(self.model.readout(h, k, k), targets)
                self.clamped_ce += ce.double().sum().item()
                self.clamped_rms.append(rms(h).flatten().cpu())

    def result(self, d: int) -> dict:
        K, count = self.K, self.count
        free_rms = torch.cat(self.token_rms[K - 1]).mean().item()
        return {
            "scale": [_distribution(torch.cat(self.token_rms[k]).numpy(), d) for k in range(K)],
            "radial": {
                "r": [torch.cat(x).mean().item() for x in self.shares],
                "g_K": self.signed_g / count,
            },
            "rollout": {
                "loops": list(range(1, self.deepest + 1)),
                "s": [torch.cat(x).mean().item() for x in self.token_rms],
                "ce": (self.ce / count).tolist(),
                **{key: (v / count).tolist() for key, v in self.roll.items()},
            },
            "scale_sweep": {"c": SCALES.tolist(), "ce": (self.sweep / count).tolist()},
            "clamp": {
                "norm_ratio": torch.cat(self.clamped_rms).mean().item() / free_rms,
                "ce_clamped": self.clamped_ce / count,
                "ce_free": self.ce[K - 1] / count,
                "delta_ce": (self.clamped_ce - self.ce[K - 1]) / count,
                "max_rms_drift_from_loop1": self.clamp_drift,
            },
            "label_path": (
                dict(zip(("ce", "entropy", "top_logit_margin"), self.label_path / count))
                if self.gated
                else None
            ),
        }


def _distribution(values: np.ndarray, d: int) -> dict:
    """Token-level ‖H_k‖_rms statistics (L2 = √d·RMS) and its quantile curve."""
    stats = {"mean": float(values.mean()), "max": float(values.max())}
    stats.update({f"p{p:g}": float(np.percentile(values, p)) for p in PERCENTILES})
    return {
        "rms": stats,
        "l2": {k: v * math.sqrt(d) for k, v in stats.items()},
        "quantiles": np.percentile(values, np.linspace(0, 100, 101)).tolist(),
    }


def markdown(result: dict) -> str:
    s = result["settings"]
    K = s["num_loops_trained"]
    lines = [
        f"# Diagnostics: {result['model']['path']}",
        "",
        f"{s['tokens']:,} tokens of {s['data']} ({s['sequences']} x {s['seq_len']}), trained "
        f"at K = {K}, d = {s['hidden_size']}.",
        "",
        "## Hidden scale per loop (token-level ‖H_k‖_rms; L2 norm = √d·RMS)",
        "",
        "| loop | mean | p50 | p90 | p99 | p99.9 | max | mean L2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, dist in enumerate(result["scale"], start=1):
        r = dist["rms"]
        lines.append(
            f"| {k} | {r['mean']:.4g} | {r['p50']:.4g} | {r['p90']:.4g} | "
            f"{r['p99']:.4g} | {r['p99.9']:.4g} | {r['max']:.4g} | "
            f"{dist['l2']['mean']:.4g} |"
        )
    radial = result["radial"]
    lines += [
        "",
        "## Radial gradient fraction of each exit's loss",
        "",
        "| loop | r_k |",
        "|---|---|",
    ]
    lines += [f"| {k} | {r:.3e} |" for k, r in enumerate(radial["r"], start=1)]
    lines += [
        "",
        f"Signed g_K = ∂L/∂log‖H_K‖ = {radial['g_K']:.3e}.",
        "",
        f"## Rollout to {s['rollout']} loops",
        "",
        "| loop | s_k (RMS) | a_rad,k | Δs_k measured | ‖b_k‖_rms | angle (deg) | CE |",
        "|---|---|---|---|---|---|---|",
    ]
    roll = result["rollout"]
    for i, k in enumerate(roll["loops"]):
        step = (
            f"{roll['a_rad'][i]:.4g} | {roll['scale_step'][i]:.4g} | "
            f"{roll['update_rms'][i]:.4g} | {roll['angle_deg'][i]:.3g}"
            if i < len(roll["a_rad"])
            else " | | | "
        )
        lines.append(f"| {k} | {roll['s'][i]:.4g} | {step} | {roll['ce'][i]:.4f} |")
    sweep, clamp = result["scale_sweep"], result["clamp"]
    lines += ["", f"## Final-readout CE of c·H_{K}", "", "| c | CE |", "|---|---|"]
    lines += [f"| {c:.3g} | {v:.4f} |" for c, v in zip(sweep["c"], sweep["ce"])]
    lines += [
        "",
        "## Recurrent-scale clamp",
        "",
        f"Norm ratio (clamped / free RMS at K = {K}): {clamp['norm_ratio']:.4g}; "
        f"ΔCE (clamped − free): {clamp['delta_ce']:+.4f} nats "
        f"(free {clamp['ce_free']:.4f}); largest token RMS drift from loop 1 under the "
        f"clamp: {clamp['max_rms_drift_from_loop1']:.1e}.",
    ]
    label = result["label_path"]
    if label is not None:
        lines += [
            "",
            "## Label path (Ouro's objective: CE of Σ_k p_k·logits_k)",
            "",
            f"CE {label['ce']:.4f}, mean entropy {label['entropy']:.4f} nats, mean "
            f"top-1 − top-2 logit margin {label['top_logit_margin']:.4f}; final r_K "
            f"{radial['r'][-1]:.3e}.",
        ]
    return "\n".join(lines)
