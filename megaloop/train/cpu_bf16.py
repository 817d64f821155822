"""Whether this CPU computes in bf16 natively, and the warning `megaloop train` gives when
train.bf16 is on where it does not.

Without bf16 instructions (x86 without avx512_bf16 or amx_bf16, Arm without the bf16 feature)
torch emulates bf16 arithmetic: the study preset at d=96 took 35 s a step under bf16 against
3 s in fp32 on an AVX2 AMD EPYC (7-12x, docs/study.md). torch's own capability string does not
tell: "AVX512" covers CPUs with and without bf16. The CPU's flags in /proc/cpuinfo do; where
there is none (not Linux), nothing is said.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""The /proc/cpuinfo flags of bf16 arithmetic: x86's AVX-512 BF16 and AMX-BF16 (`flags`), Arm's
BF16 extension (`Features`)."""

DISPATCH_WARNING = r"Mismatch dtype between input and weight"
"""torch's warning (once a process) when a bf16 activation meets an fp32 RMSNorm weight, as under
autocast with model.fp32_residual off: the fused kernel is skipped. On such a CPU the warning
below names the larger cost, and its fix."""


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str | None:
    """The text of /proc/cpuinfo, or None where there is none."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def native_bf16(cpuinfo: str | None) -> bool | None:
    """Whether the CPU that `cpuinfo` (/proc/cpuinfo's text) describes has bf16 instructions;
    None when the text names no flags at all (unknown)."""
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return not BF16_FLAGS.isdisjoint(value.split())
    return None


def slow_bf16_warning(bf16: bool, on_gpu: bool, cpuinfo: str | None) -> str | None:
    """The warning for train.bf16 on a CPU known to lack bf16 instructions, else None."""
    if not bf16 or on_gpu or native_bf16(cpuinfo) is not False:
        return None
    return (
        "train.bf16 is on, and this CPU has no bf16 instructions (none of "
        f"{', '.join(sorted(BF16_FLAGS))} among its /proc/cpuinfo flags): torch emulates bf16, "
        "so a step takes 7-12x as long as in fp32 (docs/study.md, At CPU scale). Give "
        "train.bf16=false to train in fp32"
    )


def warn_if_slow(bf16: bool, on_gpu: bool, cpuinfo: str | None) -> str | None:
    """Print slow_bf16_warning on stderr, once, and then silence torch's dispatch warning, which
    names a cost of the same kind with no fix. Returns what was printed."""
    text = slow_bf16_warning(bf16, on_gpu, cpuinfo)
    if text is not None:
        print(f"megaloop: warning: {text}", file=sys.stderr, flush=True)
        warnings.filterwarnings("ignore", DISPATCH_WARNING, UserWarning)
    return text
