# Every target builds and uses .venv itself; the stamp makes a second run quick.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-clients test-real lint docs pictures bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' -c constraints.txt
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/routeledger up --demo --data-dir ./.routeledger

# The suite waits (on Redis, subprocesses, simulated machines) more than it computes, so it runs in
# three processes on a 2-core machine (pytest-xdist), each with its own Redis servers; more crowd the
# cores (6 took twice as long as 3 for the same files). A file's tests stay in one process (--dist
# loadfile): tests/clients shares a routeledger per module. `make test TEST_PROCESSES=0` runs it in
# this process alone (about twice as long).
TEST_PROCESSES ?= 3

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile

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
	# The manual's picture script is no package (docs/ stays a folder of pages); mypy takes it by
	# name, as the config's `packages` and a file cannot be given together.
	$(BIN)/mypy docs/pictures.py

# The manual (docs/, configured by mkdocs.yml) as a site in site/. --strict: a link to a page that
# does not exist, or a page missing from the nav, fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The manual's pictures in docs/img/ (commit them): the simulator's response-vs-load plots, drawn by
# `sim schedule --plot`, and the dashboard of a live `up --demo`, shot by headless chromium. About
# five minutes on two cores, most of it the simulations behind the plots.
pictures: $(STAMP)
	$(BIN)/python -m docs.pictures

# Each script prints its figures and a JSON line last; together they take several minutes.
bench: $(STAMP)
	$(BIN)/python -m bench.ledger
	$(BIN)/python -m bench.dispatch
	$(BIN)/python -m bench.router
	$(BIN)/python -m bench.scale
	$(BIN)/python -m bench.sizes
	$(BIN)/python -m bench.replay
	$(BIN)/python -m bench.archive
	$(BIN)/python -m bench.ledger_bytes
	$(BIN)/python -m bench.projector_start
	$(BIN)/python -m bench.longrun
	$(BIN)/python -m bench.ingest
	$(BIN)/python -m bench.cluster
	$(BIN)/python -m bench.api
	$(BIN)/python -m bench.task_events
	$(BIN)/python -m bench.backend_client
	$(BIN)/python -m bench.roundtrip
	$(BIN)/python -m bench.real_fleet

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
