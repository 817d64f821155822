"""Weight for weight, megaloop's study rows (configs/experiments/study/44m/) against the study's
released model, restated in plain PyTorch in tests/study_reference.py (issue 53).

Each row is loaded as the preset states it, shrunk to a small shape, built by megaloop with its
weights drawn from a seed and then moved off their initial values (norm weights, damping, gate),
so that a weight the comparison drops or misplaces shows. The same weights, mapped onto the
released model's names (`released_state`), go into the reference, and every exit's hidden state,
logits and gate, the loss and its gradients are compared, in fp32 at the trained depth and at
two others (K = 2, 6: where a final-only readout tells "the trained depth" from "the last loop
run"), and under bf16 autocast, where megaloop's residual stream must stay fp32.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import study_reference as reference
import torch

from megaloop import experiment, objectives
from megaloop.model.looped import build_model
from support import ROOT

FOLDER = ROOT / "configs/experiments/study/44m"
ROWS = sorted(p.stem for p in FOLDER.glob("*.yaml"))
"""Every row in the folder: one the reference does not know fails (reference.ROWS)."""

SMALL = [
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_layers=2",
    "model.ffn_hidden_size=256",
    "model.vocab_size=97",
    "model.max_seq_len=16",
    "model.dropout=0",
    "data.seq_len=16",
    "data.stride=16",
]
"""The small shape (dropout off: both sides are deterministic)."""

DEPTHS = (4, 2, 6)
"""K the model runs at: the trained depth, and a shorter and a longer one."""

FP32_TOL = 1e-5
"""Relative (max |Δ| / max |reference|): fp32 roundoff of two orderings of the same sums."""

PENDING: dict[tuple[str, int | None], str] = {}
"""(row, K, or None for every K) → why megaloop's preset does not match the released model yet;
its cases are xfail(strict), so a change that lands fails them until its entry goes. Empty: the
last ones (the gate reading raw H_k, readout last_norm, damping from sigmoid(2), the entropy
clamp 1e-8, model.fp32_residual) have landed."""


def case(row: str, depth: int | None = None):
    reason = PENDING.get((row, None)) or PENDING.get((row, depth))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(row, *([] if depth is None else [depth]), marks=marks)


def load(row: str, overrides=()):
    """The preset row at the small shape (read once: the configs are not changed here)."""
    return _load(row, tuple(SMALL), tuple(overrides))


@functools.cache
def _load(row: str, small: tuple, overrides: tuple):
    return experiment.load(FOLDER / f"{row}.yaml", [*small, *overrides])


# ---- megaloop's weights under the released model's names ----------------------------------

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attention.linear_proj.weight": "attn.out_proj.weight",
    "pre_mlp_layernorm.weight": "ffn_norm.weight",
    "mlp.linear_fc2.weight": "ffn.w2.weight",
}
TOP_NAMES = {
    "embedding.word_embeddings.weight": "token_embedding.weight",  # W_out too: tied on both sides
    "embedding.position_embeddings.weight": "position_embedding.weight",
    "readout.norm.weight": "decode_norm.weight",
    "recurrence.norm.weight": "loop_norm.weight",
    "exit_gate.proj.weight": "exit_gate.weight",
    "exit_gate.proj.bias": "exit_gate.bias",
}


def released_state(state: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """megaloop's parameters (or their gradients: the map is linear) under the released names.
    A name without a released counterpart is an error, so nothing megaloop has goes unchecked."""
    out = {}
    for name, t in state.items():
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if layer is None:
            if name == "recurrence.damping_logit":
                # the released damping is one scalar: a per-channel factor has no counterpart
                assert t.shape == (1,), f"{name} {tuple(t.shape)}: the released damping is a scalar"
                out["raw_alpha"] = t.reshape(())
            elif name in TOP_NAMES:
                out[TOP_NAMES[name]] = t
            else:
                raise KeyError(f"megaloop parameter {name} has no released counterpart")
            continue
        i, rest = layer.groups()
        prefix = f"layers.{i}."
        if rest == "self_attention.linear_qkv.weight":
            # megatron-core: per query group g the rows [q_g, k_g, v_g] (one head per group here);
            # released: [q; k; v], each head-major
            rows, d = t.shape
            hd = d // heads
            assert rows == 3 * d, "one key/value head per query head, as released"
            out[prefix + "attn.qkv.weight"] = (
                t.view(heads, 3, hd, d).transpose(0, 1).reshape(rows, d)
            )
        elif rest == "mlp.linear_fc1.weight":
            # megatron-core's gated MLP: silu(first half) * second half
            out[prefix + "ffn.w1.weight"], out[prefix + "ffn.w3.weight"] = t.chunk(2, dim=0)
        elif rest in LAYER_NAMES:
            out[prefix + LAYER_NAMES[rest]] = t
        else:
            raise KeyError(f"megaloop parameter {name} has no released counterpart")
    return out


def perturb(model, seed: int = 1) -> None:
    """Move the weights whose initial values are constants (norm weights, damping) or that the
    init leaves small (the gate) to random values, so that a dropped or misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    d = model.cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name == "recurrence.damping_logit":
                p.copy_(0.7 + 0.2 * noise)  # sigmoid ≈ 0.67: neither 2.0 (released) nor 0.9
            elif name == "exit_gate.proj.weight":
                p.copy_(noise / math.sqrt(d))
            elif name == "exit_gate.proj.bias":
                p.copy_(0.3 + 0.1 * noise)


def pair(row: str, overrides=(), seed: int = 0, mistake=None):
    """megaloop's model of the preset row (perturbed) and the reference with its weights."""
    cfg = load(row, overrides)
    model = build_model(cfg.model, seed)
    perturb(model)
    m = cfg.model
    ref = reference.ReleasedLoopLM(
        reference.ROWS[row], m.vocab_size, m.hidden_size, m.num_heads, m.num_layers, m.ffn_size,
        m.max_seq_len,
    )  # fmt: skip
    load_reference(ref, model, mistake)
    return cfg, model, ref


def load_reference(ref, model, mistake=None) -> None:
    """The reference gets megaloop's weights; what it does not get stays NaN (ReleasedLoopLM).
    `mistake` edits the mapped names first (the tests that show a wrong mapping fails)."""
    mapped = released_state(dict(model.named_parameters()), model.cfg.num_heads)
    if mistake is not None:
        mistake(mapped, dict(model.named_parameters()))
    with torch.no_grad():
        _, unexpected = ref.load_state_dict(
            {k: v.detach().clone() for k, v in mapped.items()}, strict=False
        )
    assert not unexpected, unexpected


def batch(cfg, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, cfg.model.max_seq_len)
    return (
        torch.randint(0, cfg.model.vocab_size, shape, generator=g),
        torch.randint(0, cfg.model.vocab_size, shape, generator=g),
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp64 (NaN anywhere: inf)."""
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_both(cfg, model, ref, depth: int, tokens, labels):
    """Both forwards and losses: megaloop's (sequence-first tensors turned batch-first)."""
    out = model(tokens, labels, num_loops=depth, keep_logits=True)
    loss, _ = objectives.compute(cfg.objective, out)
    r = ref(tokens, depth)
    ref_loss = reference.loss(ref.row, r, labels)
    mine = {
        "hidden": [h.transpose(0, 1) for h in out.hidden],
        "logits": [z.transpose(0, 1) for z in out.logits],
        "gates": list(out.gates),
    }
    return mine, loss, r, ref_loss


def errors(mine, loss, r, ref_loss) -> dict[str, float]:
    errs = {}
    for key in ("hidden", "logits", "gates"):
        for k, (a, b) in enumerate(zip(mine[key], r[key]), 1):
            errs[f"{key}{k}"] = rel(a, b)
    errs["loss"] = rel(loss, ref_loss)
    return errs


def gradient_errors(model, ref) -> dict[str, float]:
    grads = {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    mapped = released_state(grads, model.cfg.num_heads)
    theirs = dict(ref.named_parameters())
    errs = {}
    for name, g in mapped.items():
        ref_grad = theirs[name].grad
        errs[f"grad {name}"] = rel(g, torch.zeros_like(g) if ref_grad is None else ref_grad)
    return errs


def compare(row: str, depth: int, overrides=()) -> dict[str, float]:
    """fp32: per loop the errors of H_k, logits_k and λ_k, the loss's, and each weight's
    gradient's, between megaloop's model of `row` run at K = `depth` and the reference."""
    cfg, model, ref = pair(row, overrides)
    tokens, labels = batch(cfg)
    mine, loss, r, ref_loss = run_both(cfg, model, ref, depth, tokens, labels)
    assert len(mine["hidden"]) == len(r["hidden"]) == depth
    if ref.row.supervision == "adaptive":
        assert len(mine["gates"]) == depth, "the exit-weighted loss reads every loop's gate"
    errs = errors(mine, loss, r, ref_loss)
    loss.backward()
    ref_loss.backward()
    return errs | gradient_errors(model, ref)


# ---- fp32: every row, three depths --------------------------------------------------------


def test_every_row_of_the_preset_is_a_released_row():
    assert len(ROWS) >= 11 and ADAPTIVE and set(BF16_ROWS) <= set(ROWS)
    assert set(ROWS) <= set(reference.ROWS), "add the new row to tests/study_reference.py ROWS"


@pytest.mark.parametrize("row, depth", [case(r, k) for r in ROWS for k in DEPTHS])
def test_fp32_matches_the_released_model(row, depth):
    """Every exit's H_k, logits and gate, the loss and its gradient w.r.t. every weight, within
    1e-5 relative of the released model's on the same weights."""
    errs = compare(row, depth)
    worst = {k: v for k, v in errs.items() if not v <= FP32_TOL}
    assert not worst, f"{row} K={depth}: {worst}"


def swap(a: str, b: str):
    def edit(mapped, _):
        mapped[a], mapped[b] = mapped[b], mapped[a]

    return edit


def qkv_read_as_q_k_v(mapped, theirs):
    for i in range(2):
        mapped[f"layers.{i}.attn.qkv.weight"] = theirs[
            f"layers.{i}.self_attention.linear_qkv.weight"
        ]


def drop(name: str):
    return lambda mapped, _: mapped.pop(name)


MISTAKES = {
    "qkv read as [q; k; v], not per head": qkv_read_as_q_k_v,
    "fc1's halves swapped (silu on the linear half)": swap(
        "layers.0.ffn.w1.weight", "layers.0.ffn.w3.weight"
    ),
    "the attention and FFN norms swapped": swap(
        "layers.1.attn_norm.weight", "layers.1.ffn_norm.weight"
    ),
    "the layers in reverse order": swap("layers.0.ffn.w2.weight", "layers.1.ffn.w2.weight"),
    "the readout norm left out": drop("decode_norm.weight"),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_wrong_mapping_fails_the_comparison(mistake):
    """The comparison is only as good as `released_state`: each of these mistakes in it shows
    far above the fp32 tolerance (the perturbed norm weights make a swapped norm show)."""
    cfg, model, ref = pair("per_loop_norm", mistake=MISTAKES[mistake])
    tokens, labels = batch(cfg)
    with torch.no_grad():
        errs = errors(*run_both(cfg, model, ref, 4, tokens, labels))
    assert errs["loss"] > 1e3 * FP32_TOL or errs["logits4"] > 1e3 * FP32_TOL, errs


@pytest.mark.parametrize("row", [case(r) for r in ROWS])
def test_the_initial_weights_are_the_released_ones(row):
    """What the released code fixes at the start (norm weights 1, the damping logit 2.0) is
    megaloop's start too, and what it draws, PyTorch's defaults (embeddings N(0, 1), Linear
    and gate U(±1/√fan_in)), megaloop draws from the same distributions."""
    cfg = load(row)
    model = build_model(cfg.model, 0)
    start = released_state(dict(model.named_parameters()), cfg.model.num_heads)
    for name, w in start.items():
        w = w.detach()
        if name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w)), name
        elif name == "raw_alpha":
            assert w.item() == pytest.approx(reference.RAW_ALPHA_INIT, abs=1e-6), name
        elif name.endswith("embedding.weight"):
            assert abs(w.mean().item()) < 0.1 and w.std().item() == pytest.approx(1, abs=0.1), name
        else:  # nn.Linear's kaiming_uniform(a=√5): U(±1/√fan_in), its bias too
            bound = 1 / math.sqrt(cfg.model.hidden_size if "exit_gate" in name else w.shape[-1])
            assert w.abs().max().item() <= bound, name
            assert w.numel() < 8 or w.abs().max().item() > 0.8 * bound, name


ADAPTIVE = [r for r in ROWS if r in reference.ROWS and reference.ROWS[r].supervision == "adaptive"]
"""The rows the released code trains with its exit-weighted (`adaptive`) loss."""


@pytest.mark.parametrize("row", [case(r) for r in ADAPTIVE])
def test_a_saturated_gate_reads_the_released_entropy_clamp(row):
    """A gate at λ ≈ 1.4e-11 puts p_1..p_{K-1} below the released clamp 1e-8 (and above
    1e-12): the entropy's gradient is ln(1e-8) there, not ln(p_k) + 1, and the gate's gradient
    (made of these p_k alone) shows which clamp the loss read. The loss value cannot: p_k·ln p_k
    moves it by 1e-10."""
    cfg, model, ref = pair(row)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate = model.exit_gate.proj
        gate.weight.copy_(1e-3 * torch.randn(gate.weight.shape, generator=g))
        gate.bias.fill_(-25.0)
    load_reference(ref, model)
    tokens, labels = batch(cfg)
    mine, loss, r, ref_loss = run_both(cfg, model, ref, 4, tokens, labels)
    assert all(1e-12 < p.max() < reference.ENTROPY_CLAMP for p in r["exit_pdf"][:-1])
    loss.backward()
    ref_loss.backward()
    errs = errors(mine, loss, r, ref_loss) | gradient_errors(model, ref)
    worst = {k: v for k, v in errs.items() if not v <= FP32_TOL}
    assert not worst, worst


# ---- bf16 autocast: the residual stream stays fp32 ------------------------------------------

U = 2.0**-8
"""bf16's unit roundoff (8 significant bits): a rounding moves x by at most u·|x|."""

BF16_ROWS = ["per_loop_norm", "exit_weighted", "spectral_damping", "interloop_rmsnorm"]
"""Per-loop norm readout, the gated exit-weighted row, damping, the inter-loop norm."""


def hidden_tol(layers: int, k: int) -> float:
    """RMS-relative tolerance of H_k under autocast: ½·u·√(n/3), n = 2·L·k residual adds up to
    loop k. u·√(n/3) is the RMS of n roundings each uniform within ±u·|H| (bf16's coarsest
    spacing, 2u): what H_k would carry were it rounded to bf16 at each add, as megaloop's
    residual stream was (model.fp32_residual=false). Kept fp32 on both sides, H_k differs only
    by the bf16 sublayer outputs' rounding, which is relative to |f| < |H| and stays well below
    half of that (test_the_bf16_tolerance_tells_an_fp32_residual_from_a_bf16_one measures)."""
    return 0.5 * U * math.sqrt(2 * layers * k / 3)


LOGITS_TOL = 2 * U
"""RMS-relative, the logits and the gate: both sides round them to bf16 (Linear under autocast),
independently wherever their inputs differ: ≤ u·√(2/3) RMS apart, plus H's difference carried
through the readout (≤ hidden_tol ≈ 1.4u at K = 6) and the bf16 rounding of W_out's input."""
LOSS_TOL = U / 2
"""Relative: a mean over b·s tokens (and K loops) of fp32 cross-entropies of those logits, whose
independent rounding differences average out."""


def rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ (fp64)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def residual_dtypes(model) -> list[torch.dtype]:
    """Hooks that record the dtype of the residual stream between the sublayers (the MLP norm's
    input) and after each layer, for every layer application."""
    seen = []
    for layer in model.layers:
        layer.pre_mlp_layernorm.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].dtype)
        )
        layer.register_forward_hook(lambda m, args, out: seen.append(out[0].dtype))
    return seen


def bf16_errors(row: str, depth: int, overrides=()):
    """Both models under CPU bf16 autocast: (per-loop and overall errors, H's dtypes, the
    residual stream's dtypes)."""
    cfg, model, ref = pair(row, overrides)
    tokens, labels = batch(cfg)
    seen = residual_dtypes(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mine, loss, r, ref_loss = run_both(cfg, model, ref, depth, tokens, labels)
    assert {h.dtype for h in r["hidden"]} == {torch.float32}  # the reference's, by promotion
    errs = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
    for key in ("hidden", "logits", "gates"):
        for k, (a, b) in enumerate(zip(mine[key], r[key]), 1):
            errs[f"{key}{k}"] = rms_rel(a, b)
    return errs, {h.dtype for h in mine["hidden"]}, set(seen)


def bf16_tol(key: str, layers: int) -> float:
    if key == "loss":
        return LOSS_TOL
    if key.startswith("hidden"):
        return hidden_tol(layers, int(key.removeprefix("hidden")))
    return LOGITS_TOL


@pytest.mark.parametrize("row, depth", [case(r, k) for r in BF16_ROWS for k in (4, 6)])
def test_bf16_autocast_keeps_the_residual_fp32_and_matches_the_released_model(row, depth):
    errs, hidden, residual = bf16_errors(row, depth)
    assert hidden == residual == {torch.float32}
    layers = load(row).model.num_layers
    worst = {k: v for k, v in errs.items() if not v <= bf16_tol(k, layers)}
    assert not worst, f"{row} K={depth}: {worst}"


@pytest.mark.parametrize("row", [case(r) for r in BF16_ROWS])
def test_the_bf16_tolerance_tells_an_fp32_residual_from_a_bf16_one(row):
    """The same comparison with the residual stream cast to bf16 at each add (megatron-core's
    bias-dropout-add, model.fp32_residual=false) fails hidden_tol at every loop."""
    layers = load(row).model.num_layers
    kept, _, _ = bf16_errors(row, 6, ["model.fp32_residual=true"])
    cast, hidden, residual = bf16_errors(row, 6, ["model.fp32_residual=false"])
    assert hidden == residual == {torch.bfloat16}
    for k in range(1, 7):
        tol = hidden_tol(layers, k)
        assert kept[f"hidden{k}"] <= tol < cast[f"hidden{k}"], (k, kept, cast)
