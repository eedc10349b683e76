# diffusionrl: one Makefile for setup, the demo, the tests and the benchmarks.
# Every target that runs code depends on `setup`, which is idempotent: it (re)installs only when
# pyproject.toml changed since the last install.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU build of torch lies on local disk; installing it first keeps pip from pulling a
# multi-GB CUDA build when the project's range is resolved.
TORCH  := torch==2.13.0

export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup sglang-env demo test bench bench-gpu package images clean

setup: $(STAMP)

# SGLang's diffusion runtime in its own venv (it pins torch 2.14.1, transformers 5.19, diffusers
# 0.37): pins in requirements/sglang-constraints.txt, its pure-Python needs in requirements/sglang.txt
# (docs/sglang.md). ~6 GB; reinstalls only when those files change. Skip with SGLANG_ENV= (empty).
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_C     := requirements/sglang-constraints.txt
SGLANG_ENV   ?= $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP): requirements/sglang.txt $(SGLANG_C)
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q torch torchvision -c $(SGLANG_C)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang -c $(SGLANG_C)
	$(SGLANG_VENV)/bin/python -m pip install -q -r requirements/sglang.txt -c $(SGLANG_C)
	$(SGLANG_VENV)/bin/python -c "import sglang.multimodal_gen, triton, torch; print('sglang env ok, torch', torch.__version__)"
	@touch $(SGLANG_STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

# The main job on the embedded default (tiny-cpu-shapes: GenEval in miniature, the base model's
# weights ship with the code, nothing is pretrained here): the Flyte workflow, executed locally. The
# MLflow store (runs/mlflow) is kept across demos: each demo registers a new version that must
# beat the current @champion, and the base model's strict score, to replace it.
demo: setup
	rm -rf runs/demo
	HF_HUB_OFFLINE=1 $(BIN)/pyflyte run workflows/grpo.py grpo --checkpoint_dir $(CURDIR)/runs/demo
	@echo ""
	@echo "report:       runs/demo/report.html"
	@echo "LoRA:         runs/demo/lora (EMA: runs/demo/lora_ema when train.ema is on)"
	@echo "trajectories: runs/demo/trajectories/step-*.parquet"
	@echo "metrics:      runs/demo/metrics.jsonl, checkpoints: runs/demo/checkpoints"
	@echo "MLflow:       runs/mlflow (open: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/runs/mlflow/mlflow.db)"
	@echo "registry:     $(BIN)/python -m diffusionrl.serving show"
	@$(BIN)/python -m diffusionrl.serving show

# The two environments install side by side (pip unpacks on one core), then the tests run in TEST_WORKERS
# processes (pytest-xdist), each taking whole modules, the longest first (tests/conftest.py); TEST_WORKERS=0
# runs them in this process. pytest exits 5 when it collected no test: that is a failure here, not a pass.
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j2 setup $(SGLANG_ENV)
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests; \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench: setup $(SGLANG_ENV)
	$(BIN)/python bench/exactness.py
	$(BIN)/python bench/rollout_overhead.py
	$(BIN)/python bench/learning.py
	$(BIN)/python bench/rewards.py
	$(BIN)/python bench/pipeline_overhead.py
	$(BIN)/python bench/sglang_vs_local.py
	$(BIN)/python bench/sft.py
	$(BIN)/python bench/shape_edits.py

# On a GPU machine only (never in CI): CUDA IPC push, rollout images/s and train step time for an
# SD3.5-medium-sized transformer; the JSON goes to bench/results/ with the date.
bench-gpu: setup
	@mkdir -p bench/results
	@out=bench/results/gpu_scaleout-$$(date +%F).json; $(BIN)/python bench/gpu_scaleout.py > $$out.tmp || exit 1; \
	cat $$out.tmp; if grep -q '"skipped"' $$out.tmp; then rm $$out.tmp; else mv $$out.tmp $$out; echo "-> $$out"; fi

# The registrable archive of both workflows, their launch plans and all tasks (pyflyte package),
# offline: no cluster, no Docker, no registry lookups. --copy all is fast registration: the code,
# configs/ and pyproject.toml go into the archive's code tarball, unpacked under /root in the pods;
# the images hold only the dependencies (images/__init__.py). The templates name
# DIFFUSIONRL_IMAGE_REGISTRY/diffusionrl-{cpu,gpu}:TAG (a placeholder registry when it is unset).
# Register it with `flytectl register files --archive dist/flyte-package.tgz --version V`.
PACKAGE ?= dist/flyte-package.tgz

package: setup
	@mkdir -p $(dir $(PACKAGE))
	DIFFUSIONRL_IMAGES_OFFLINE=1 PYTHONPATH=$(CURDIR) $(BIN)/pyflyte --pkgs workflows --pkgs tasks \
	  package --copy all --force --output $(PACKAGE)

# Build and push the CPU and GPU images that DIFFUSIONRL_IMAGE_REGISTRY lacks (needs Docker with
# buildx and, for a remote registry, docker login); prints one line per missing piece otherwise.
images: setup
	PYTHONPATH=$(CURDIR) $(BIN)/python -m images build

clean:
	rm -rf runs .pytest_cache dist
