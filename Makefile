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

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

# The main job on the embedded default (tiny-cpu): the Flyte workflow, executed locally. The
# MLflow store (runs/mlflow) is kept across demos: each demo registers a new version that must
# beat the current @champion to replace it.
demo: setup
	rm -rf runs/demo
	HF_HUB_OFFLINE=1 $(BIN)/pyflyte run workflows/grpo.py grpo --checkpoint_dir $(CURDIR)/runs/demo
	@echo ""
	@echo "report:       runs/demo/report.html"
	@echo "LoRA:         runs/demo/lora (EMA: runs/demo/lora_ema when train.ema is on)"
	@echo "trajectories: runs/demo/trajectories/step-*.parquet"
	@echo "metrics:      runs/demo/metrics.jsonl, checkpoints: runs/demo/checkpoints"
	@echo "MLflow:       runs/mlflow (open: $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/runs/mlflow/mlflow.db)"
	@echo "registry:     $(BIN)/python -m diffusionrl.registry show"
	@$(BIN)/python -m diffusionrl.registry show

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/python bench/exactness.py
	$(BIN)/python bench/rollout_overhead.py
	$(BIN)/python bench/learning.py
	$(BIN)/python bench/rewards.py
	$(BIN)/python bench/pipeline_overhead.py

clean:
	rm -rf runs .pytest_cache
