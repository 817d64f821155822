"""What a measurement is asked to do: typed settings, passed by keyword to each `run()`.

The command line builds them from its options (megaloop/commands/); Python callers build them
directly. A value out of range fails on construction with one error naming the option, before
a model is opened. Settings that depend on the model (the window length) are fitted to it once
it is open (`fitted`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Self


class EvalError(ValueError):
    """Bad evaluation input (settings, model folder, data, task names, local data)."""


DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "bf16": "bfloat16",
}
"""`--dtype`'s values (the short spellings too). auto, every measurement's default: bfloat16 on
a GPU (the study's precision), float32 on a CPU."""

Rule = Literal["margin", "gate"]
RULES: tuple[Rule, ...] = ("margin", "gate")
SPLITS = ("validation", "default")


def option(name: str) -> str:
    """A setting's command-line spelling: batch_size → --batch-size."""
    return "--" + name.replace("_", "-")


def positive(why: str, **values: int | None) -> None:
    """EvalError naming every option below 1 (None: not given, checked later)."""
    low = [f"{option(k)} {v}" for k, v in values.items() if v is not None and v < 1]
    if low:
        raise EvalError(f"{', '.join(low)}: must be >= 1 ({why})")


def loop_counts(loops) -> tuple[int, ...]:
    """Sorted, distinct loop counts, each >= 1."""
    loops = list(loops)
    counts = tuple(sorted(set(loops)))
    if not counts or counts[0] < 1:
        given = ",".join(map(str, loops))
        raise EvalError(f"--loops {given!r}: give loop counts >= 1, e.g. 1,2,3,4,8")
    return counts


def parse_loops(text: str) -> tuple[int, ...]:
    """`--loops 1,2,4` as loop counts."""
    try:
        return loop_counts(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise EvalError(f"--loops {text!r}: give loop counts >= 1, e.g. 1,2,3,4,8") from None


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What every measurement of a model over a slice of held-out tokens shares."""

    model: Path
    """A run directory, a checkpoint folder or a `megaloop export` folder."""
    data: Path
    """Held-out tokens: text, a .npy of ids, an indexed split PREFIX or webdataset shards."""
    seq_len: int | None = None
    """Tokens per window. None: the model's positions, at most `longest_default`."""
    batch_size: int = 8
    dtype: str = "auto"
    """A key of DTYPES; stored as the full name (auto, float32, bfloat16)."""
    device: str | None = None
    """None: a GPU when there is one, else the CPU."""
    out: Path | None = None
    """Where the results are written (None: nowhere)."""

    longest_default: ClassVar[int] = 256

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised once, here
        set_(self, "model", Path(self.model))
        set_(self, "data", Path(self.data))
        if self.out is not None:
            set_(self, "out", Path(self.out))
        if self.dtype not in DTYPES:
            raise EvalError(f"--dtype {self.dtype}: give one of {', '.join(DTYPES)}")
        set_(self, "dtype", DTYPES[self.dtype])
        self.validate()

    def validate(self) -> None:
        """Range checks of this kind's own settings (subclasses extend it)."""
        positive(
            "an empty slice measures nothing", seq_len=self.seq_len, batch_size=self.batch_size
        )

    def fitted(self, positions: int) -> Self:
        """These settings for a model of `positions` positions: seq_len defaults to them (at
        most `longest_default`); a given seq_len must fit in them."""
        if self.seq_len is None:
            return dataclasses.replace(self, seq_len=min(self.longest_default, positions))
        if self.seq_len > positions:
            raise EvalError(
                f"--seq-len {self.seq_len}: the model takes 1 to {positions} positions "
                f"(max_position_embeddings)"
            )
        return self

    def record(self, **resolved) -> dict:
        """The settings as a result records them: data as text, `resolved` (device, dtype)
        over the requested values; the model and the output folder are recorded elsewhere."""
        names = [f.name for f in dataclasses.fields(self) if f.name not in ("model", "out")]
        kept = {k: getattr(self, k) for k in names}
        kept = {k: list(v) if isinstance(v, tuple) else v for k, v in kept.items()}
        return {**kept, "data": str(self.data), **resolved}


@dataclass(frozen=True, kw_only=True)
class DepthSettings(Measurement):
    """`megaloop depth`: fixed-depth CE at each K from one pass."""

    loops: tuple[int, ...] = (1, 2, 3, 4)
    sequences: int = 160
    clamp: bool = False
    """Hold every loop at its loop-1 RMS (the recurrent-scale clamp)."""

    def validate(self) -> None:
        super().validate()
        positive("an empty slice measures nothing", sequences=self.sequences)
        object.__setattr__(self, "loops", loop_counts(self.loops))


@dataclass(frozen=True, kw_only=True)
class HaltSettings(Measurement):
    """`megaloop halt`: calibrate a halting threshold on one slice, time it on the next."""

    k_max: int = 4
    rho: float = 1.01
    """PPL budget: dynamic PPL <= rho x fixed-K_max PPL on the calibration slice."""
    calib: int = 160
    bench: int = 160
    rule: Rule = "margin"
    threshold: float | None = None
    """Given: τ (margin) or q (gate), and calibration only reports it. None: calibrated."""

    def validate(self) -> None:
        if self.rho < 1:
            raise EvalError(
                f"--rho {self.rho}: the PPL budget is a ratio to fixed-K_max PPL, >= 1 "
                f"(the study: 1.01)"
            )
        super().validate()
        positive(
            "an empty slice measures nothing", k_max=self.k_max, calib=self.calib, bench=self.bench
        )
        if self.rule not in RULES:
            raise EvalError(f"--rule {self.rule}: give one of {', '.join(RULES)}")


@dataclass(frozen=True, kw_only=True)
class DiagnoseSettings(Measurement):
    """`megaloop diagnose`: scale, radial gradients, rollout, scale sweep, clamp."""

    tokens: int = 4096
    """Held-out tokens in the slice (rounded up to whole windows)."""
    rollout: int = 30

    def validate(self) -> None:
        if self.rollout < 2:
            raise EvalError(f"--rollout {self.rollout}: needs at least 2 loops")
        super().validate()
        positive("an empty slice measures nothing", tokens=self.tokens)


@dataclass(frozen=True, kw_only=True)
class FixedKSettings(Measurement):
    """`megaloop bench fixed-k`: tokens/s and CE at each fixed K. `out` is a JSON file."""

    loops: tuple[int, ...] = (1, 2, 3, 4)
    batch_size: int = 1
    batches: int = 8
    """Timed batches (the study: 128)."""
    warmup: int = 2
    """Untimed batches first."""

    longest_default: ClassVar[int] = 128

    def validate(self) -> None:
        super().validate()
        positive("an empty slice measures nothing", batches=self.batches)
        if self.warmup < 0:
            raise EvalError(f"--warmup {self.warmup}: must be >= 0")
        object.__setattr__(self, "loops", loop_counts(self.loops))


@dataclass(frozen=True, kw_only=True)
class DownstreamSettings:
    """`megaloop eval downstream`: lm-eval multiple-choice tasks on an export at K loops."""

    model: Path
    """A `megaloop export` folder."""
    loops: int
    tasks: tuple[str, ...] | None = None
    """lm-eval task names; None: the study's nine."""
    out: Path = Path("eval_results")
    limit: int | None = None
    """At most this many examples per task."""
    data_dir: Path | None = None
    """The built-in tasks from DIR/<task>/<split>.jsonl instead of the hub."""
    batch_size: int = 8
    device: str | None = None
    split: str = "validation"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "model", Path(self.model))
        set_(self, "out", Path(self.out))
        if self.data_dir is not None:
            set_(self, "data_dir", Path(self.data_dir))
        if self.tasks is not None:
            set_(self, "tasks", tuple(self.tasks))
        positive("K and the batch are counts", loops=self.loops, batch_size=self.batch_size)
        positive("an empty evaluation measures nothing", limit=self.limit)
        if self.split not in SPLITS:
            raise EvalError(f"--split {self.split}: give one of {', '.join(SPLITS)}")


EXITS = {"gate": "gate", "margin": "margin", "fixed": "none", "none": "none"}
"""`--exit`'s values → the exported config's early_exit (fixed, alias none: every token runs K)."""
KV_POLICIES = ("copy", "share", "recompute")


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """`megaloop generate`: text from an export, each new token stopping at its exit loop."""

    model: Path
    """A `megaloop export` folder (or `megaloop import ouro` then `export`)."""
    prompt: str | None = None
    prompts: Path | None = None
    """A text file, one prompt per line (blank lines skipped); give it or `prompt`."""
    exit: str = "fixed"
    """A key of EXITS."""
    threshold: float | None = None
    """The rule's threshold (gate: cumulative exit probability; margin: top-1 − top-2 logit)."""
    loops: int | None = None
    """K, the most loops a token runs. None: the model's num_loops."""
    kv: str = "copy"
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0: greedy; above 0: sampling at this temperature."""
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    batch_size: int = 8
    """Prompts of --prompts generated together (left-padded)."""
    show_depth: bool = False
    dtype: str = "auto"
    device: str | None = None
    json: Path | None = None
    """Where to write prompts, completions, each token's exit loop and the summary."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "model", Path(self.model))
        for name in ("prompts", "json"):
            if getattr(self, name) is not None:
                set_(self, name, Path(getattr(self, name)))
        if (self.prompt is None) == (self.prompts is None):
            raise EvalError("give one of --prompt TEXT and --prompts FILE")
        if self.exit not in EXITS:
            raise EvalError(f"--exit {self.exit}: give one of gate, margin, fixed")
        if self.kv not in KV_POLICIES:
            raise EvalError(f"--kv {self.kv}: give one of {', '.join(KV_POLICIES)}")
        if self.dtype not in DTYPES:
            raise EvalError(f"--dtype {self.dtype}: give one of {', '.join(DTYPES)}")
        set_(self, "dtype", DTYPES[self.dtype])
        self.check_threshold()
        self.check_sampling()
        positive(
            "counts of loops, tokens and prompts",
            loops=self.loops,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
        )
        self.texts()

    @property
    def rule(self) -> str:
        """The exported config's early_exit: none, gate or margin."""
        return EXITS[self.exit]

    def check_threshold(self) -> None:
        if self.rule == "none":
            if self.threshold is not None:
                raise EvalError(
                    f"--threshold is for --exit gate or margin; --exit {self.exit} runs every "
                    "token --loops loops (drop --threshold or give --exit gate|margin)"
                )
        elif self.threshold is None:
            raise EvalError(
                f"--exit {self.exit} needs --threshold T (e.g. a threshold `megaloop halt` "
                "calibrated; --exit fixed runs every token K loops)"
            )
        elif self.threshold != self.threshold:
            raise EvalError("--threshold nan: give a number")

    def threshold_note(self) -> str | None:
        """What a threshold out of the rule's useful range does (legitimate, e.g. for testing)."""
        t = self.threshold
        if self.rule == "gate" and t > 1 or self.rule == "margin" and t == float("inf"):
            return f"--threshold {t} never exits early: every token runs all K loops"
        if t is not None and t <= 0:
            return f"--threshold {t} exits every token at loop 1 (its score is never below 0)"
        return None

    def check_sampling(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise EvalError(f"--temperature {self.temperature}: give 0 (greedy) or more")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise EvalError(
                "--top-k and --top-p shape sampling, and --temperature 0 is greedy: give "
                "--temperature T > 0 too"
            )
        positive("the most likely tokens sampled from", top_k=self.top_k)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise EvalError(f"--top-p {self.top_p}: give a probability in (0, 1]")

    def texts(self) -> list[str]:
        """The prompts: --prompt, or the non-blank lines of --prompts."""
        if self.prompts is None:
            if not self.prompt:
                raise EvalError("--prompt is empty: give some text to continue")
            return [self.prompt]
        if not self.prompts.is_file():
            raise EvalError(f"--prompts {self.prompts}: no such file (one prompt per line)")
        try:
            lines = self.prompts.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise EvalError(f"--prompts {self.prompts}: not UTF-8 text ({e.reason})") from None
        texts = [line for line in lines if line.strip()]
        if not texts:
            raise EvalError(f"--prompts {self.prompts}: no prompts (one per line, blank skipped)")
        return texts
