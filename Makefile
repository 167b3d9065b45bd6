# make demo : set up .venv and render the tiny Wan clip once per backend that runs here, stitched into a grid
# make test : set up .venv and run the test suite (what CI runs), without the tests marked `minutes`
# make test-all : the same with them (kernels in whole renders under Triton's interpreter, benches' subprocess runs)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vdbench-installed
DEMO   ?= outputs/demo

.PHONY: setup test test-all demo clean

# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q -m 'not minutes'

test-all: setup
	$(PY) -m pytest -q

demo: setup
	@start=$$(date +%s); \
	PYTHON=$(PY) bash render_all_WAN.sh --model-path tiny --output-dir $(DEMO) --stitch --report; rc=$$?; \
	echo "demo finished in $$(( $$(date +%s) - start )) s (exit $$rc)"; \
	echo "  grid:                $(DEMO)/comparison_grid.mp4 (labels: warm ms/step, PSNR vs reference)"; \
	echo "  report:              $(DEMO)/report.html (and summary.csv)"; \
	echo "  per-backend videos:  $(DEMO)/results/wan_result_*.mp4"; \
	echo "  timing:              $(DEMO)/results/timing.json"; \
	echo "  logs:                $(DEMO)/logs/"; \
	echo "next: open the report; on a GPU render a real model with the kernels you compare, e.g."; \
	echo "  $(PY) run_wan.py --list_backends"; \
	echo "  bash render_all_WAN.sh --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\"; \
	echo "      --types sdpa_cudnn,fav3,sagev1,reference --stitch --report          # on a GPU"; \
	echo "  bash render_all_WAN.sh --nproc 2 ...                                      # each render on 2 GPUs"; \
	exit $$rc

clean:
	rm -rf outputs .pytest_cache
