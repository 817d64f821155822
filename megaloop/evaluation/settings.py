"""What a measurement is asked to do: typed settings, passed by keyword to each `run()`.

The command line builds them from its options (megaloop/commands/); Python callers build them
directly. A value out of range fails on construction with one error naming the option, before
a model is opened. Settings that depend on the model (the window length) are fitted to it once
it is open (`fitted`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self

from megaloop.config import ConfigError
from megaloop.flags import internal, option, setting
from megaloop.model.modes import EXIT_RULES, KV_POLICIES, asynchronous_policies, gate_missing


class EvalError(ConfigError):
    """Bad evaluation input (settings, model folder, data, task names, local data), named by
    its command-line option or file: a ConfigError, reported in one line by every command."""


DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "bf16": "bfloat16",
}
"""`--dtype`'s values (the short spellings too). auto, every measurement's default: bfloat16 on
a GPU (the study's precision), float32 on a CPU."""

MODEL_KINDS = "a run directory, a checkpoint folder or a `megaloop export` folder"
"""What MODEL may name, for every command that reads a model (its help, its errors)."""

SPLITS = ("validation", "default")
RESAMPLES = 10_000
"""`eval compare`'s bootstrap resamples by default."""


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
            f"--threshold {text!r}: give finite numbers, comma-separated, e.g. 0.5,0.9 ({scores()})"
        )
    return tuple(sorted(set(values)))


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What every measurement of a model over a slice of held-out tokens shares."""

    model: Path = setting(positional=True, help=MODEL_KINDS)
    data: Path
    """held-out tokens: a text file, a .npy of ids, an indexed split PREFIX (PREFIX.bin/.idx) or
    webdataset shards"""
    seq_len: int | None = setting(
        None,
        help=lambda cls: (
            "tokens per window (default: the model's positions, at most "
            f"{cls.longest_default}{cls.study_note})"
        ),
    )
    batch_size: int = 8
    """windows per batch"""
    dtype: str = setting("auto", choices=DTYPES)
    """auto: bfloat16 on a GPU (the study's precision), float32 on a CPU"""
    device: str | None = None
    """e.g. cpu, cuda:0 (default: a GPU when there is one)"""

    longest_default: ClassVar[int] = 256
    study_note: ClassVar[str] = ""

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

    def fitted(self, positions: int, trained: int | None = None, learned: bool = False) -> Self:
        """These settings for a model of `positions` positions that trained on windows of
        `trained` tokens (None: not recorded): seq_len defaults to the trained length (at most
        `longest_default` and `positions`); a given seq_len must fit in the positions, and one
        past the trained length of a model with `learned` positions is said (rows of the table
        no step trained)."""
        if self.seq_len is None:
            longest = min(self.longest_default, positions, trained or positions)
            return dataclasses.replace(self, seq_len=longest)
        if self.seq_len > positions:
            raise EvalError(
                f"--seq-len {self.seq_len}: the model takes 1 to {positions} positions "
                f"(max_position_embeddings)"
            )
        if learned and trained is not None and self.seq_len > trained:
            print(
                f"megaloop: warning: --seq-len {self.seq_len} is longer than the {trained}-token "
                f"windows the model trained on: its learned positions {trained} to "
                f"{self.seq_len - 1} were never trained (give --seq-len {trained} or less)",
                file=sys.stderr,
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

    loops: tuple[int, ...] = setting((1, 2, 3, 4), parse=parse_loops)
    """loop counts K to read, comma-separated, e.g. 1,2,3,4,8"""
    clamp: bool = False
    """hold every loop at its loop-1 RMS (the recurrent-scale clamp)"""
    sequences: int = 160
    """windows in the slice"""
    out: Path | None = setting(None, required=True)
    """folder: writes OUT/depth.json and OUT/depth.md"""

    def validate(self) -> None:
        super().validate()
        positive("an empty slice measures nothing", sequences=self.sequences)
        object.__setattr__(self, "loops", loop_counts(self.loops))


@dataclass(frozen=True, kw_only=True)
class HaltSettings(Measurement):
    """`megaloop halt`: calibrate a halting threshold on one slice, time it on the next."""

    k_max: int = setting(4, name="--loops")
    """K_max: the most loops a token runs, and the fixed depth the PPL budget and the speedup are
    measured against"""
    rho: float = 1.01
    """PPL budget: dynamic PPL <= rho x fixed-K_max PPL on the calibration slice"""
    calib: int = 160
    """calibration sequences"""
    bench: int = 160
    """benchmark sequences (the windows after the calibration slice)"""
    rule: str = setting(
        "margin",
        name="--exit",
        choices=EXIT_RULES,
        help=lambda cls: (
            f"exit rule: the first loop whose score >= T ({scores()}), per token; "
            "margin per sequence, its tokens' mean (the study's)"
        ),
    )
    threshold: float | None = None
    """the --exit rule's T, given instead of calibrated, which calibration only reports (default:
    calibrated to the PPL budget)"""
    out: Path | None = setting(None, required=True)
    """folder: writes OUT/halt.json and OUT/halt.md"""

    def validate(self) -> None:
        if self.rho < 1:
            raise EvalError(
                f"--rho {self.rho}: the PPL budget is a ratio to fixed-K_max PPL, >= 1 "
                f"(the study: 1.01)"
            )
        super().validate()
        positive(
            "an empty slice measures nothing", loops=self.k_max, calib=self.calib, bench=self.bench
        )
        one_of("--exit", self.rule, EXIT_RULES)


@dataclass(frozen=True, kw_only=True)
class DiagnoseSettings(Measurement):
    """`megaloop diagnose`: scale, radial gradients, rollout, scale sweep, clamp."""

    tokens: int = 4096
    """held-out tokens in the slice (rounded up to whole windows)"""
    rollout: int = 30
    """loops of the rollout"""
    out: Path | None = setting(None, required=True)
    """folder: writes OUT/diagnose.json and OUT/diagnose.md"""

    def validate(self) -> None:
        if self.rollout < 2:
            raise EvalError(f"--rollout {self.rollout}: needs at least 2 loops")
        super().validate()
        positive("an empty slice measures nothing", tokens=self.tokens)


@dataclass(frozen=True, kw_only=True)
class FixedKSettings(Measurement):
    """`megaloop bench fixed-k`: tokens/s and CE at each fixed K. `out` is a JSON file."""

    batch_size: int = 1
    """windows per batch"""
    loops: tuple[int, ...] = setting((1, 2, 3, 4), parse=parse_loops)
    """loop counts K to time, comma-separated"""
    batches: int = 8
    """timed batches (study: 128)"""
    warmup: int = 2
    """untimed batches first"""
    out: Path | None = None
    """JSON file of the results, and a PNG of the PPL-throughput frontier beside it (default: the
    table is printed only)"""

    longest_default: ClassVar[int] = 128
    study_note: ClassVar[str] = "; study: 2048, --batch-size 2"

    def validate(self) -> None:
        super().validate()
        positive("an empty slice measures nothing", batches=self.batches)
        if self.warmup < 0:
            raise EvalError(f"--warmup {self.warmup}: must be >= 0")
        object.__setattr__(self, "loops", loop_counts(self.loops))


SYNTHETIC_TASKS = ("addition", "lookup", "chase")
"""data.SyntheticConfig's tasks, whose answers `bench generate --task` scores."""
BATCHING: tuple[str, ...] = ("sync", "async")
"""How a batch decodes under early exit: `sync`, every row at the same token, each loop run by
the rows still active; `async`, every row at its own loop (DepthAsyncDecoder; `copy` and
`share`, batch > 1)."""


def scores() -> str:
    """Each exit rule's score, for help texts and errors: `gate: ...; margin: ...`."""
    return "; ".join(f"{name}: {rule.summary}" for name, rule in EXIT_RULES.items())


def default_thresholds() -> str:
    """Each exit rule's default thresholds, for help texts: `gate 0.3,0.5; margin ...`."""
    return "; ".join(
        f"{name} {','.join(f'{t:g}' for t in rule.thresholds)}" for name, rule in EXIT_RULES.items()
    )


def kv_policies() -> str:
    """Each KV policy in a few words, for help texts."""
    return "; ".join(f"{name}: {policy.summary}" for name, policy in KV_POLICIES.items())


def one_of(option_: str, value: str, allowed) -> None:
    """EvalError unless `value` is one of `allowed` (names, or a table keyed by them)."""
    if value not in allowed:
        raise EvalError(f"{option_} {value}: give one of {', '.join(allowed)}")


def check_gate(rule: str, has_gate: bool, model) -> None:
    """EvalError for an exit rule that reads the gate, on a model without one."""
    why = gate_missing(rule, has_gate, str(model))
    if why:
        raise EvalError(why)


def names(option_: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list of names, each one of `allowed`, in the order given, without repeats."""
    given = tuple(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    bad = [w for w in given if w not in allowed]
    if not given or bad:
        raise EvalError(
            f"{option_} {text!r}: give one or more of {', '.join(allowed)}, comma-separated"
        )
    return given


def numbers(option_: str, text: str, kind: type, example: str) -> tuple:
    """A comma list of numbers of `kind`, sorted and distinct."""
    try:
        values = tuple(sorted({kind(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        values = ()
    if not values:
        raise EvalError(f"{option_} {text!r}: give comma-separated numbers, e.g. {example}")
    return values


@dataclass(frozen=True, kw_only=True)
class GenerateBenchSettings(Measurement):
    """`megaloop bench generate`: teacher-forced cached decoding under each exit rule, threshold
    and KV policy, and at each fixed K, at each batch size. `out` is a folder."""

    batch_size: int = internal(8)
    """The largest of batch_sizes (set from them)."""
    rules: tuple[str, ...] | None = setting(
        None,
        name="--exit",
        parse=lambda text: tuple(text.split(",")),
        help=lambda cls: (
            f"exit rules, comma-separated, by their score: {scores()} (default: "
            "every rule the model can run; one that reads the gate needs an exit gate)"
        ),
    )
    thresholds: tuple[float, ...] | None = setting(
        None,
        name="--threshold",
        parse=lambda text: numbers("--threshold", text, float, "0.5,0.9"),
        help=lambda cls: (
            "every rule's thresholds, comma-separated (default per rule: "
            f"{default_thresholds()}; `megaloop halt`'s calibrated value is the point to add)"
        ),
    )
    policies: tuple[str, ...] = setting(
        tuple(KV_POLICIES),
        name="--kv",
        parse=lambda text: tuple(text.split(",")),
        help=lambda cls: f"KV policies, comma-separated ({kv_policies()})",
    )
    batching: tuple[str, ...] = setting(
        BATCHING,
        parse=lambda text: tuple(text.split(",")),
        help=lambda cls: (
            "sync (every row at the same token) and/or async (every row at its own "
            f"loop: {', '.join(asynchronous_policies())}, batch > 1), comma-separated"
        ),
    )
    batch_sizes: tuple[int, ...] = setting(
        (1, 8), name="--batch-size", parse=lambda text: numbers("--batch-size", text, int, "1,8")
    )
    """rows decoded together, comma-separated: one run each"""
    prompt: int = setting(4, name="--prompt-tokens")
    """tokens prefilled at full depth before the decoded ones (untimed); at least 2, since a
    forward of one token is a decoded one (it exits by the rule)"""
    repeats: int = 3
    """timed decodes per run (the fastest counts: load only slows a decode)"""
    batches: int = 1
    """batches of different windows each run decodes (its tokens/s, CE and accuracy are over all
    of them)"""
    task: str | None = setting(None, choices=SYNTHETIC_TASKS)
    """the built-in corpus --data was written from: also score its answers (CE, accuracy) and
    draw the frontier in accuracy (default: none, any text, CE only)"""
    out: Path | None = setting(None, required=True)
    """folder for generate.json, .md and .png"""

    longest_default: ClassVar[int] = 128

    def validate(self) -> None:
        set_ = object.__setattr__
        if self.rules is not None:
            set_(self, "rules", names("--exit", ",".join(self.rules), tuple(EXIT_RULES)))
        set_(self, "policies", names("--kv", ",".join(self.policies), tuple(KV_POLICIES)))
        set_(self, "batching", names("--batching", ",".join(self.batching), BATCHING))
        if self.task is not None and self.task not in SYNTHETIC_TASKS:
            raise EvalError(
                f"--task {self.task}: give one of {', '.join(SYNTHETIC_TASKS)} (the built-in "
                "corpus the --data text was written from), or leave it out for any text"
            )
        if self.thresholds is not None:
            thresholds = tuple(sorted(set(map(float, self.thresholds))))
            if not thresholds or any(not 0 <= t < float("inf") for t in thresholds):
                raise EvalError(
                    f"--threshold {','.join(map(str, self.thresholds))!r}: give finite numbers "
                    ">= 0, e.g. 0.5,0.9 (a gate's cumulative probability, a margin in logits)"
                )
            set_(self, "thresholds", thresholds)
        batch_sizes = tuple(sorted(set(self.batch_sizes)))
        if not batch_sizes or batch_sizes[0] < 1:
            raise EvalError(
                f"--batch-size {','.join(map(str, self.batch_sizes))!r}: give batch sizes >= 1, "
                "e.g. 1,8"
            )
        set_(self, "batch_sizes", batch_sizes)
        set_(self, "batch_size", batch_sizes[-1])
        super().validate()
        positive("a run decodes and times something", repeats=self.repeats, batches=self.batches)
        if self.prompt < 2:
            raise EvalError(
                f"--prompt-tokens {self.prompt}: give 2 or more (a forward of one token is "
                "decoded, exiting by the rule, not prefilled at full depth)"
            )
        self.check_prompt()

    def check_prompt(self) -> None:
        """The window (once known) holds the prompt and at least one decoded token."""
        if self.seq_len is not None and self.seq_len <= self.prompt:
            raise EvalError(
                f"--seq-len {self.seq_len}: must exceed --prompt-tokens {self.prompt} "
                "(the tokens after the prompt are the decoded ones)"
            )

    def exit_rules(self, has_gate: bool) -> tuple[str, ...]:
        """The rules to run on a model with or without an exit gate."""
        if self.rules is None:
            return tuple(r for r in EXIT_RULES if not gate_missing(r, has_gate, ""))
        for rule in self.rules:
            check_gate(rule, has_gate, self.model)
        return self.rules

    def thresholds_of(self, rule: str) -> tuple[float, ...]:
        return EXIT_RULES[rule].thresholds if self.thresholds is None else self.thresholds


@dataclass(frozen=True, kw_only=True)
class DownstreamSettings:
    """`megaloop eval downstream`: lm-eval multiple-choice tasks on a model at K loops."""

    model: Path = setting(positional=True, help=MODEL_KINDS)
    loops: int
    """K, the loops every token runs (K_max under --exit)"""
    tasks: tuple[str, ...] | None = setting(
        None, parse=lambda text: tuple(t for t in text.split(",") if t) or None
    )
    """comma-separated lm-eval tasks (default: the study's nine)"""
    limit: int | None = None
    """at most this many examples per task (default: all of them)"""
    data_dir: Path | None = None
    """run the built-in tasks from DIR/<task>/<split>.jsonl (hub schema) instead of the hub
    (default: the hub)"""
    batch_size: int = 8
    """examples per forward pass"""
    device: str | None = internal(None)
    split: str = setting("validation", choices=SPLITS)
    """validation (the study: every task's validation split) or default (the split lm-eval
    evaluates each task on)"""
    exit: str | None = setting(None, choices=EXIT_RULES)
    """also score with adaptive depth under this exit rule (K_max = --loops), once per
    --threshold, beside fixed K (default: fixed K only)"""
    thresholds: tuple[float, ...] = setting(
        (),
        name="--threshold",
        parse=parse_thresholds,
        help=lambda cls: (
            "the --exit rule's thresholds, comma-separated, on its score: "
            f"{scores()} (required with --exit)"
        ),
    )
    out: Path = setting(Path("eval_results"), required=True)
    """folder of the results (results, samples, summary)"""

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
        if self.exit is not None:
            one_of("--exit", self.exit, EXIT_RULES)
        if (self.exit is None) != (not self.thresholds):
            given, missing = ("--exit", "--threshold") if self.exit else ("--threshold", "--exit")
            raise EvalError(
                f"{given} needs {missing}: adaptive depth is a rule "
                f"(--exit {'|'.join(EXIT_RULES)}) and its thresholds (--threshold T[,T2,...]) "
                "together"
            )
        if self.thresholds:
            set_(self, "thresholds", parse_thresholds(",".join(map(str, self.thresholds))))


EXITS = {**{rule: rule for rule in EXIT_RULES}, "fixed": "none", "none": "none"}
"""`--exit`'s values → the exported config's early_exit (every rule of modes.EXIT_RULES by its
own name; fixed, alias none: every token runs K): the one place an exit rule changes name
between the command line and the model."""


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """`megaloop generate`: text from a model, each new token stopping at its exit loop."""

    model: Path = setting(
        positional=True, help=f"{MODEL_KINDS} (Ouro's weights: `megaloop import ouro` then export)"
    )
    prompt: str | None = setting(None, group="prompt")
    """the text to continue (printed as it is generated)"""
    prompts: Path | None = setting(None, group="prompt")
    """a text file, one prompt per line (blank lines skipped), in batches"""
    exit: str = setting(
        "fixed",
        choices=EXITS,
        help=lambda cls: (
            f"a token exits at the first loop whose score >= T ({scores()}); fixed "
            "(or none): every token runs K loops"
        ),
    )
    threshold: float | None = None
    """the --exit rule's T, e.g. the one `megaloop halt` calibrated (required with an exit
    rule)"""
    loops: int | None = None
    """K, the most loops a token runs (default: the model's)"""
    kv: str = setting(
        "copy",
        choices=KV_POLICIES,
        help=lambda cls: f"what a token's skipped (loop, layer) cache slots hold: {kv_policies()}",
    )
    batching: str = setting(
        "auto",
        choices=("auto", *BATCHING),
        help=lambda cls: (
            "sync: a batch's rows decode a token together (one prompt streams); "
            "async: every row at its own loop, no row waiting for the deepest "
            f"({', '.join(asynchronous_policies())}; printed when done); auto: async for a "
            "batch of prompts under an exit rule with a policy it runs, else sync"
        ),
    )
    max_new_tokens: int = 64
    """new tokens per prompt"""
    temperature: float = 0.0
    """0: greedy; > 0: sampling"""
    top_k: int | None = None
    """sample from the k most likely tokens (default: all of them)"""
    top_p: float | None = None
    """sample from the smallest set of mass >= p (default: all tokens)"""
    seed: int | None = None
    """torch.manual_seed before sampling, for reproducible draws (default: unseeded)"""
    batch_size: int = 8
    """prompts of --prompts at a time (left-padded)"""
    show_depth: bool = False
    """follow each new token's text with ⟨its exit loop⟩"""
    dtype: str = setting("auto", choices=DTYPES)
    """auto: bfloat16 on a GPU, float32 on a CPU"""
    device: str | None = None
    """e.g. cpu, cuda:0 (default: a GPU when there is one)"""
    out: Path | None = None
    """JSON file: the settings, prompts, completions, each token's exit loop and the summary
    (default: none written)"""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "model", Path(self.model))
        for name in ("prompts", "out"):
            if getattr(self, name) is not None:
                set_(self, name, Path(getattr(self, name)))
        if (self.prompt is None) == (self.prompts is None):
            raise EvalError("give one of --prompt TEXT and --prompts FILE")
        one_of("--exit", self.exit, EXITS)
        one_of("--kv", self.kv, KV_POLICIES)
        one_of("--batching", self.batching, ("auto", *BATCHING))
        if self.batching == "async" and self.kv not in asynchronous_policies():
            runs = " or ".join(asynchronous_policies())
            raise EvalError(
                f"--batching async decodes --kv {runs} ({self.kv} resumes earlier tokens at the "
                "loop a row needs, a synchronous step): give another --kv or --batching sync"
            )
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
    def early_exit(self) -> str:
        """The exported config's early_exit for `--exit` (EXITS, the one mapping)."""
        return EXITS[self.exit]

    def batching_of(self, rows: int) -> str:
        """How a batch of `rows` prompts decodes. `auto`: depth-asynchronously where rows can
        exit at different loops and the policy allows it (more than one row, an exit rule,
        copy or share), since a synchronous step waits for its deepest row; else in sync (one
        prompt streams)."""
        if self.batching != "auto":
            return self.batching
        takes_async = rows > 1 and self.early_exit != "none" and self.kv in asynchronous_policies()
        return "async" if takes_async else "sync"

    def check_threshold(self) -> None:
        if self.early_exit == "none":
            if self.threshold is not None:
                raise EvalError(
                    f"--threshold is for an exit rule ({', '.join(EXIT_RULES)}); --exit "
                    f"{self.exit} runs every token --loops loops (drop --threshold or give "
                    f"--exit {'|'.join(EXIT_RULES)})"
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
        if self.early_exit == "none":
            return None
        t, (low, high) = self.threshold, EXIT_RULES[self.early_exit].bounds
        if t > high or t == float("inf"):
            return f"--threshold {t} never exits early: every token runs all K loops"
        if t <= low:
            return f"--threshold {t} exits every token at loop 1 (its score is never below {low:g})"
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
