# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install
# the pinned dependencies first (torch==2.13.0 before anything else can ask for another torch).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)

# The Slurm tests bring up a real local cluster (slurm/local/up.sh): Debian's packages, ~13 MB.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge

.PHONY: demo test test-fast lint install slurm clean docs-config

install: $(STAMP)

# pip compiles what it installs one file at a time; compileall does it on every core (201 ->
# about 150 s for this lock, 2 cores). Left out: torch's one Python 3.12-only test helper.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) .ci/check_lock.py
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 -x 'torch/testing/_internal/py312_intrinsics' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/megaloop demo

slurm:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $(SLURM_PACKAGES) >/dev/null; \
	  else \
	    echo "make: Slurm is not installed and this is not a root Debian shell; the cluster" \
	         "tests in tests/cluster/test_slurm.py will be skipped (apt-get install $(SLURM_PACKAGES))"; \
	  fi; \
	fi

PYTEST := HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q
# The in-process tests spread over the cores (pytest-xdist, one thread each; a file's tests stay
# on one worker, with its fixtures). `make test` adds to that pass the multi-process tests whose
# processes run one after another (marker one_at_a_time). Then the other multi-process tests one
# at a time (their ranks take the cores; two at once measured no faster, 2026-12-06, and slowed
# the DeepSpeed tests up to 7x), and beside them the Slurm tests, a cluster that mostly waits on
# its scheduler; their log follows. --durations: the log names where the suite's time goes.
# Files go out in collection order (xdist's default sends the files with the most tests first),
# so the few long multi-process files start first and the many short ones fill in at the end.
XDIST := -n auto --dist loadfile --no-loadscope-reorder
IN_PROCESS := $(XDIST) -m "not multiprocess and not slurm"
SHARED := $(XDIST) -m "(not multiprocess or one_at_a_time) and not slurm"

test: $(STAMP) slurm lint
	$(PYTEST) $(SHARED) --durations=15
	log=$$(mktemp); $(PYTEST) -m slurm --durations=5 >$$log 2>&1 & slurm=$$!; \
	$(PYTEST) -m "multiprocess and not one_at_a_time" --durations=15; multi=$$?; \
	wait $$slurm; cluster=$$?; echo "== the Slurm tests, run beside the pass above"; \
	cat $$log; rm -f $$log; [ $$multi = 0 ] && [ $$cluster = 0 ]

# ruff (lint and format) and the import contracts of pyproject.toml (docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# docs/config.md, the config-key reference, from the config dataclasses (megaloop/config_reference.py;
# tests/unit/test_config_reference.py fails when it is stale). Written whole or not at all.
docs-config: $(STAMP)
	$(PY) -m megaloop.config_reference > docs/config.md.tmp
	mv docs/config.md.tmp docs/config.md

# Everything but the multi-process and Slurm-cluster tests (markers in pyproject.toml): 8 min here.
test-fast: $(STAMP)
	$(PYTEST) $(IN_PROCESS)

clean:
	rm -rf $(VENV) runs
