"""What a measurement is asked to do: typed settings, passed by keyword to each `run()`.

The command line builds them from its options (megaloop/commands/); Python callers build them
directly. A value out of range fails on construction with one error naming the option, before
a model is opened. Settings that depend on the model (the window length) are fitted to it once
it is open (`fitted`).
"""

from __future__ import annotations

import dataclasses
import math
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


def parse_thresholds(text: str) -> tuple[float, ...]:
    """`--threshold 0.5,0.9` as sorted, distinct, finite numbers."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(t) for t in values):
        raise EvalError(
            f"--threshold {text!r}: give finite numbers, comma-separated, e.g. 0.5,0.9 "
            f"(gate: a cumulative exit probability; margin: a top-1 minus top-2 logit)"
        )
    return tuple(sorted(set(values)))


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
    exit: Rule | None = None
    """Also score with adaptive depth under this exit rule, K_max = `loops`, once per threshold."""
    thresholds: tuple[float, ...] = ()

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
        if self.exit is not None and self.exit not in RULES:
            raise EvalError(f"--exit {self.exit}: give one of {', '.join(RULES)}")
        if (self.exit is None) != (not self.thresholds):
            given, missing = ("--exit", "--threshold") if self.exit else ("--threshold", "--exit")
            raise EvalError(
                f"{given} needs {missing}: adaptive depth is a rule (--exit gate|margin) "
                f"and its thresholds (--threshold T[,T2,...]) together"
            )
        if self.thresholds:
            set_(self, "thresholds", parse_thresholds(",".join(map(str, self.thresholds))))
