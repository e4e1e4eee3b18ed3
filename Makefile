# rollstream: the first two targets set everything up on a fresh machine.
#   make demo   install, start a local Kafka broker, run the embedded RL demo, clean up
#   make test   install, start a broker, run every test, stop it
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test bench chaos fleet install jars lint broker-start broker-stop clean

demo: install jars
	$(VENV)/bin/rollstream demo

test: install jars
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install jars
	$(PY) -m tests.bench

# Seeded randomized faults against a private local broker, then 0 lost / 0 duplicated / audit green (not in `test`).
chaos: install jars
	$(PY) -m tests.chaos $(CHAOS_ARGS)

# 100+ producers on a private 3-node cluster, poll vs pushed backpressure at two fleet sizes (not in `test`).
fleet: install jars
	$(PY) -m tests.fleet $(FLEET_ARGS)

install: $(STAMP)

# The venv persists between runs; it is rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,hf,trl,export]'
	touch $(STAMP)

# Resolve the pinned Apache Kafka jars from Maven Central into ~/.cache/rollstream (once).
jars: install
	$(PY) -c "from rollstream.infra.broker import ensure_kafka_jars; print(ensure_kafka_jars())"

# ruff over everything; mypy over the rollstream namespace (settings in pyproject.toml). mypy cannot follow the
# install-time folder mapping (rollstream.schemas is schemas/, ...), so it reads a tree of links laid out as installed.
TYPECHECK := build/typecheck
lint: install
	$(VENV)/bin/ruff check schemas infra producers consumers rollstream tests
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/rollstream
	find $(CURDIR)/rollstream -mindepth 1 -maxdepth 1 ! -name __pycache__ -exec ln -s {} $(TYPECHECK)/rollstream/ \;
	ln -s $(CURDIR)/schemas $(CURDIR)/infra $(CURDIR)/producers $(CURDIR)/consumers $(TYPECHECK)/rollstream/
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml

broker-start: install
	$(VENV)/bin/rollstream broker start

broker-stop: install
	$(VENV)/bin/rollstream broker stop

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
