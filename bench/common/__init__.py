"""What the benches share: the workers, the alternated timing, the miniature's data and
measurements, the study's runs and verdicts, and the report helpers.

SMOKE is the runner's --smoke: `python -m bench` sets it before it imports the bench, whose
sizes are read from it at import, and the workers set it in their processes the same way."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOKE = False
