# Two commands set up everything on a fresh machine:
#   make demo   runs the main job on its embedded default
#   make test   runs the test suite
# Each creates (or reuses) the virtual environment .venv and installs what it needs,
# torch==2.13.0 first (a CPU build where one is on disk; PyPI's CUDA build elsewhere).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
MEGATRON_SPEC ?= megatron-core==0.19.2

.PHONY: demo test clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH_SPEC)
	touch $@

# megatron-core declares Python >= 3.12 but runs on 3.11; its own dependencies come with ours.
$(VENV)/.megatron: $(VENV)/.torch
	$(PIP) --no-deps --ignore-requires-python $(MEGATRON_SPEC)
	touch $@

$(VENV)/.base: $(VENV)/.megatron setup.cfg pyproject.toml
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.megatron setup.cfg pyproject.toml
	$(PIP) -e '.[test,deepspeed]'
	touch $@

# SGLang (the `sglang` extra of setup.cfg) pins another torch: each package goes in --no-deps beside ours.
$(VENV)/.sglang: $(VENV)/.test setup.cfg
	$(PIP) --no-deps $$($(PY) -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); \
		print(' '.join(c['options.extras_require']['sglang'].split()))")
	touch $@

# Transformer Engine's Python only (the `transformer-engine` extra), --no-deps, in a folder of its own
# off sys.path: without its CUDA core library `import transformer_engine` raises RuntimeError, which
# megatron-core's ImportError probes would not catch (tests/support/te_cpu.py imports from there).
$(VENV)/.te: $(VENV)/.test setup.cfg
	$(PIP) --no-deps --upgrade --target $(VENV)/te-python $$($(PY) -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); \
		print(' '.join(c['options.extras_require']['transformer-engine'].split()))")
	touch $@

demo: $(VENV)/.base
	OMP_NUM_THREADS=1 $(VENV)/bin/trace-rl train

# Two pytest workers, a test file to one worker (its module fixtures are built once): most tests spawn
# ranks and SGLang processes whose imports leave a core idle in one worker.
test: $(VENV)/.sglang $(VENV)/.te
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
