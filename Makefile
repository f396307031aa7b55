# Every target builds and uses .venv itself; the stamp makes a second run quick.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-clients test-real lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' -c constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/routeledger up --demo --data-dir ./.routeledger

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The client tier alone (tests/clients, part of make test): curl, litellm, the llm CLI, LangChain and
# the openai and ollama SDKs, unchanged, against a running routeledger; well under a minute.
test-clients: $(STAMP)
	$(BIN)/python -m pytest -q -m clients tests/clients

# The real-server tier (tests/real): routeledger in front of real llama.cpp servers. The first run
# on a machine builds llama-server into ~/.cache/routeledger (about 15 minutes on two cores; needs
# cmake, g++ and cpulimit); the tier itself takes about 15 minutes.
test-real: $(STAMP)
	$(BIN)/python -m pytest -q -m real tests/real

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Each script prints its figures and a JSON line last; together they take several minutes.
bench: $(STAMP)
	$(BIN)/python bench/ledger.py
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/router.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/replay.py
	$(BIN)/python bench/archive.py
	$(BIN)/python bench/ledger_bytes.py
	$(BIN)/python bench/projector_start.py
	$(BIN)/python bench/longrun.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/task_events.py
	$(BIN)/python bench/backend_client.py
	$(BIN)/python bench/roundtrip.py
	$(BIN)/python bench/real_fleet.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
