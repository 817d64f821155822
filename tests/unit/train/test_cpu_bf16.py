"""Whether this CPU computes in bf16 natively, and the warning `megaloop train` gives where it does
not (megaloop/train/cpu_bf16.py)."""

import warnings

import pytest
import torch

from megaloop.cli import main
from support import TINY

AVX2_EPYC = (  # /proc/cpuinfo of the AMD EPYC the slow bf16 steps were measured on (issue 54)
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC Processor\n"
    "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes\n"
)


SAPPHIRE_RAPIDS = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"


COOPER_LAKE = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16\n"


SKYLAKE_AVX512 = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl\n"  # AVX-512, no bf16


GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 crc32 atomics bf16 i8mm sve\n"


GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize(
    "cpuinfo, native",
    [
        (AVX2_EPYC, False),
        (SKYLAKE_AVX512, False),
        (GRAVITON2, False),
        (SAPPHIRE_RAPIDS, True),
        (COOPER_LAKE, True),
        (GRAVITON3, True),
        (None, None),  # no /proc/cpuinfo (macOS): unknown, nothing said
        ("processor\t: 0\n", None),
    ],
)
def test_native_bf16_is_read_from_the_cpus_flags(cpuinfo, native):
    from megaloop.train import cpu_bf16

    assert cpu_bf16.native_bf16(cpuinfo) is native
    warned = cpu_bf16.slow_bf16_warning(True, False, cpuinfo)
    assert (warned is not None) == (native is False)
    assert cpu_bf16.slow_bf16_warning(False, False, cpuinfo) is None  # fp32: nothing to say
    assert cpu_bf16.slow_bf16_warning(True, True, cpuinfo) is None  # the GPU computes


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 runs on the GPU here")
@pytest.mark.parametrize("cpuinfo, warned", [(AVX2_EPYC, True), (SAPPHIRE_RAPIDS, False)])
def test_train_bf16_on_a_cpu_without_bf16_warns_once_naming_the_override(
    tmp_path, capsys, monkeypatch, cpuinfo, warned
):
    from megaloop.train import cpu_bf16

    monkeypatch.setattr(cpu_bf16, "read_cpuinfo", lambda: cpuinfo)
    run = [f"train.dir={tmp_path / 'run'}", "data.seq_len=32", "--dry-run"]
    assert main(["train", TINY, "train.bf16=true", *run]) == 0
    err = capsys.readouterr().err
    assert err.count("train.bf16=false") == int(warned), err
    if warned:
        (line,) = [x for x in err.splitlines() if "train.bf16=false" in x]
        assert line.startswith("megaloop: warning: train.bf16 is on, and this CPU has no bf16")
    assert main(["train", TINY, "train.bf16=false", *run]) == 0
    assert "train.bf16" not in capsys.readouterr().err


def test_the_warning_replaces_torchs_dispatch_warning():
    """torch warns once a process when a bf16 input meets an fp32 RMSNorm weight (made to warn
    every time here); after the slow-bf16 warning it says nothing."""
    from megaloop.train import cpu_bf16

    def dispatch_warnings() -> list[str]:
        x, weight = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cpu_bf16.warn_if_slow(True, False, cpuinfo)
            torch.nn.functional.rms_norm(x, (8,), weight)
        return [str(w.message) for w in caught if "Mismatch dtype" in str(w.message)]

    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        cpuinfo = SAPPHIRE_RAPIDS
        assert len(dispatch_warnings()) == 1  # the warning this test can see
        cpuinfo = AVX2_EPYC
        assert dispatch_warnings() == []
    finally:
        torch.set_warn_always(was)
