PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	.venv/bin/superfluid-noded --listen 127.0.0.1:8454 --model builtin

test: $(STAMP)
	$(PY) -m pytest -q

# The engine bench compares against Hugging Face transformers, installed here only: it is no
# runtime dependency of the node.
bench: $(STAMP)
	$(PY) -c 'import transformers' 2>/dev/null || $(PY) -m pip install -q transformers
	$(PY) tests/bench/codec.py
	$(PY) tests/bench/engine.py

clean:
	rm -rf .venv .pytest_cache .hypothesis
