# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install
# the pinned dependencies first (torch==2.13.0 before anything else can ask for another torch).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/megaloop demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
