"""Output a page shows as printed is what the command prints today: docs/slurm.md's 1.4B
example, the sbatch script and the layout line, rendered again from the command above them."""

import re
import sys

from megaloop.cli import main
from support import ROOT

SLURM_MD = ROOT / "docs/slurm.md"
PLACEHOLDER = "/path/to/megaloop"
"""Where the page's checkout sits; the page says it stands for your own path."""


def example(page: str, heading: str) -> tuple[str, str, str]:
    """Under `heading`: the command (first shell block), the script it prints (second) and the
    stderr line (the first plain block)."""
    section = page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)
    command, script = [text for language, text in blocks if language == "bash"][:2]
    stderr = next(text for language, text in blocks if language == "")
    return re.sub(r"\\\n\s*", "", command), script, stderr


def test_the_slurm_example_is_what_submit_prints(capsys, monkeypatch, tmp_path):
    command, script, layout = example(
        SLURM_MD.read_text(), "Example: the 1.4B run on 16 nodes × 8 GPUs"
    )
    words = command.split()
    assert words[:3] == ["megaloop", "slurm", "submit"] and "--dry-run" in words
    monkeypatch.chdir(tmp_path)  # the config by its shipped name, as from any directory
    from megaloop.data import WebDatasetConfig

    # the page's data/fineweb is on its cluster's filesystem, which `submit` checks; not here
    monkeypatch.setattr(WebDatasetConfig, "check_files", lambda self: None)
    assert main(words[1:]) == 0
    out, err = capsys.readouterr()
    here = out.replace(sys.executable, f"{PLACEHOLDER}/.venv/bin/python").replace(
        str(ROOT), PLACEHOLDER
    )
    assert here == script, "docs/slurm.md's script is stale: paste the dry run's output"
    assert err.strip() == layout.strip(), "docs/slurm.md's layout line is stale"
