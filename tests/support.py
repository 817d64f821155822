"""What test files share: the repository's paths, the tiny config, the `megaloop` command run as
a user runs it, and synthetic text for the data pipelines (Wikitext-style articles, web pages).
Test files import from here, never from each other."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/experiments/tiny.yaml")

COMMAND_TIMEOUT = 300
"""Seconds a `megaloop` command may take before the test fails (a hang, not a slow machine)."""


def env() -> dict:
    """The environment child processes run in: one thread each, no W&B."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def bench_env(**variables) -> dict:
    """The environment of a bench's smoke run: this Python (PYTHON), no W&B, and the bench's own
    `variables` (its scratch folder, the source texts), as text."""
    given = {name: str(value) for name, value in variables.items()}
    return {**os.environ, "PYTHON": sys.executable, "WANDB_MODE": "disabled", **given}


def megaloop(
    *args,
    extra_env: dict | None = None,
    cwd: Path | None = None,
    timeout: int = COMMAND_TIMEOUT,
) -> subprocess.CompletedProcess:
    """`python -m megaloop ARGS` in env() plus `extra_env` (a value of None unsets a variable)."""
    child = env()
    for key, value in (extra_env or {}).items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    return subprocess.run(
        [sys.executable, "-m", "megaloop", *map(str, args)],
        capture_output=True,
        text=True,
        env=child,
        cwd=cwd,
        timeout=timeout,
    )


def eval_downstream(model, out, loops, *options) -> int:
    """`megaloop eval downstream MODEL --loops LOOPS OPTIONS --out OUT` in this process (its
    errors reach capsys): the exit status."""
    from megaloop.cli import main

    return main(
        ["eval", "downstream", str(model), "--loops", str(loops), *map(str, options)]
        + ["--out", str(out)]
    )


# -- synthetic text ------------------------------------------------------------------------------

WORDS = (
    "the of and to in that is was for with as on by at from his her they which this be "
    "river city music history people water garden winter market school letter morning "
    "painter harbour village station theatre engine island forest summer journey story "
    "built opened wrote carried crossed lived found moved became turned remained named "
    "small large early later northern southern famous quiet bright ancient narrow"
).split()
CONTENT_WORDS = WORDS[WORDS.index("river") :]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 14))]
    return " ".join(words).capitalize() + "."


def article(rng: random.Random, paragraphs: int = 3) -> str:
    return "\n".join(" ".join(sentence(rng) for _ in range(4)) for _ in range(paragraphs))


def wikitext(rng: random.Random, titles) -> str:
    """Wikitext-103's raw layout: ` = Title = ` articles with a ` = = Section = = ` each, and a
    formula line that looks like a heading but is not one."""
    parts = [" \n"]
    for title in titles:
        parts.append(f" = {title} = \n \n {article(rng, 2)} \n \n = = Section = = \n \n")
        parts.append(f" {sentence(rng)} \n = 1 rad / s and impedance k = \n 1 ohm . \n \n")
    return "".join(parts)


def source_dir(root: Path) -> Path:
    """ROOT/source, new and empty: where a test writes a corpus's raw files."""
    source = root / "source"
    source.mkdir()
    return source


def miniature_source(tmp_path: Path, seed: int) -> Path:
    """TMP/source with bench/repro_mini's inputs: wiki.test.raw (trained on, 40 articles) and
    wiki.valid.raw (20)."""
    rng = random.Random(seed)
    source = source_dir(tmp_path)
    (source / "wiki.test.raw").write_text(wikitext(rng, [f"Train {i}" for i in range(40)]))
    (source / "wiki.valid.raw").write_text(wikitext(rng, [f"Valid {i}" for i in range(20)]))
    return source


def web_documents(rng: random.Random) -> tuple[list[dict], dict[str, dict]]:
    """Eight good pages, and one page for each quality filter to drop (named by the filter)."""
    good = [{"text": article(rng, 3)} for _ in range(8)]
    designed = {
        "repeated": {"text": "\n".join(["The same line about the river and the city."] * 30)},
        "no_stop_words": {
            "text": "\n".join(
                " ".join(rng.choice(CONTENT_WORDS) for _ in range(12)).capitalize() + "."
                for _ in range(8)
            )
        },
        "curly": {"text": article(rng, 3) + "\nfunction() { return the value; }"},
        "empty": {"text": "   "},
        "binary": {"text": "".join(chr(c) for c in range(1, 30)) * 200},
    }
    return good, designed


# -- the tiny model and its exports --------------------------------------------------------------

TINY_MODEL = dict(
    vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, num_loops=4, max_seq_len=32
)
"""The tiny model's settings, the one place they are written: tests that need another shape
override them (tiny_config) rather than spell a model out again."""


def tiny_config(**overrides):
    """TINY_MODEL as a ModelConfig, `overrides` replacing its fields."""
    from megaloop.model import ModelConfig

    return ModelConfig(**{**TINY_MODEL, **overrides})


def tiny_export(seed: int = 0, gate_scale: float = 0.3, **model):
    """A tiny trainer model (tiny_config with 2 key/value heads and 64 positions, `model`
    overriding them) with its norms and damping moved off their initial constants, exported in
    memory to transformers, its exit gate (if any) drawn at `gate_scale` so that tokens exit at
    different loops."""
    return tiny_pair(seed, gate_scale, **model)[1]


def tiny_pair(seed: int = 0, gate_scale: float = 0.3, **model):
    """(trainer, export) of tiny_export: the trainer model in eval mode, and its export."""
    import torch

    from conftest import build
    from megaloop.export import hf_model
    from megaloop.parallel import distributed

    distributed.init(seed=0)  # a no-op in a test, which has its world already
    cfg = tiny_config(**{"num_query_groups": 2, "max_seq_len": 64, **model})
    trainer = build(cfg, seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if any(part in name for part in ("norm", "damping")):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    state = {
        k: v
        for k, v in trainer.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }
    hf = hf_model(state, cfg).eval()
    if hf.exit_gate is not None:
        with torch.no_grad():
            hf.exit_gate.weight.copy_(
                gate_scale * torch.randn(hf.exit_gate.weight.shape, generator=g)
            )
            hf.exit_gate.bias.zero_()
    return trainer, hf


def write_export(hf, folder: Path) -> Path:
    """`hf` as `megaloop export` writes a folder: safetensors, its code files and their hashes
    recorded, the byte tokenizer (end of text: id 0)."""
    import json
    import shutil

    from megaloop.export import AUTO_MAP, CODE_DIR, CODE_FILES, own_code, save_tokenizer

    hf.save_pretrained(folder)
    for name in CODE_FILES:
        shutil.copyfile(CODE_DIR / name, folder / name)
    save_tokenizer("bytes", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(auto_map=AUTO_MAP, megaloop_code=own_code())
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- early exit in the exported model: the two wirings the generation tests decode with ----------

MODELS = {
    # megaloop's own wiring: final_norm readout, damped recurrence, the clamp on
    "own": dict(readout="final_norm", recurrence="damping", exit_gate=True, tie_embeddings=False),
    # Ouro's: sandwich norms, one shared loop norm (next loop, gate, readout), the exit gate
    "ouro": dict(
        readout="norm",
        exit_gate=True,
        tie_embeddings=False,
        layer_norms="sandwich",
        loop_norm="shared",
    ),
    # learned positions added to H_0, no rotation in attention (the study's released code)
    "learned": dict(
        readout="final_norm",
        recurrence="damping",
        exit_gate=True,
        tie_embeddings=False,
        position_embedding="learned",
    ),
}


def exit_model(name: str):
    """MODELS[name] as a tiny export (the clamp on for megaloop's own wiring), with `middle`:
    per rule, a threshold at which tokens exit at different loops."""
    hf = tiny_export(seed=3, **MODELS[name])
    hf.config.clamp = name == "own"
    hf.middle = middle_thresholds(hf)
    return hf


def middle_thresholds(hf) -> dict[str, float]:
    """Per rule, the median of its scores at loops 1..K-1 on some text: a threshold at which
    tokens exit at different loops (asserted where used)."""
    import torch

    from megaloop.model.modes import EXIT_RULES
    from megaloop.model.semantics import Survival

    scores = {rule: [] for rule in EXIT_RULES}
    survivals = {rule: Survival() for rule in EXIT_RULES}
    with torch.no_grad():
        h0, rope = hf.embed(prompts(8, 12, seed=9))
        for k, h in hf.loops(h0, rope, hf.config.num_loops - 1, hf.config.clamp):
            lam, logits = hf.exit_probability(h)[..., 0], hf.readout(h, k, hf.config.num_loops - 1)
            for rule, spec in EXIT_RULES.items():
                scores[rule].append(spec.score(survivals[rule], lam, logits))
    return {rule: torch.cat(s).median().item() for rule, s in scores.items()}


def greedy(hf, prompt, new_tokens=6, cache=None, **fields):
    """(tokens, per-step logits [steps, b, V]) of greedy cached generation under config `fields`."""
    import torch

    from megaloop.evaluation.generate_bench import configured

    with configured(hf, **fields), torch.no_grad():
        out = hf.generate(
            prompt,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
            past_key_values=cache,
        )
    return out.sequences, torch.stack(out.logits)


def prompts(batch: int, length: int = 6, seed: int = 0):
    """[batch, length] random token ids of the tiny vocabulary (no 0: the pad)."""
    import torch

    vocab = TINY_MODEL["vocab_size"]
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded():
    """(long, short, batch, mask): two prompts of the tiny vocabulary (9 and 5 tokens) and the
    batch of both, the short one left-padded with 4 zeros that its attention mask hides."""
    import torch

    g, vocab = torch.Generator().manual_seed(5), TINY_MODEL["vocab_size"]
    long, short = (
        torch.randint(1, vocab, (1, 9), generator=g),
        torch.randint(1, vocab, (1, 5), generator=g),
    )
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    return long, short, batch, mask


def teacher_forced(hf, tokens, cache, **fields):
    """Logits [b, s, V] of `tokens` fed one position at a time through `cache`."""
    import torch

    from megaloop.evaluation.generate_bench import configured

    with configured(hf, **fields), torch.no_grad():
        steps = [
            hf(tokens[:, i : i + 1], past_key_values=cache).logits for i in range(tokens.shape[1])
        ]
    return torch.cat(steps, 1)
