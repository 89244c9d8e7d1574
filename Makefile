PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo lint test bench bench-first-step bench-local-tier soak clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo_crash_resume.py

lint: $(STAMP)  # ruff with the rules in pyproject.toml, then mypy on the core
	$(BIN)/ruff check .
	$(BIN)/mypy diffckpt

# Test files run side by side, TEST_WORKERS at a time (pytest-xdist), each file's tests on one
# worker (module fixtures such as the uninterrupted reference runs are computed once): the suite
# waits on training subprocesses about half the time, so 2 workers on 2 cores take ~40% off.
TEST_WORKERS ?= 2

# The 20 slowest tests are listed at the end: the suite must stay under 25 minutes on CI's 2
# cores, and a new test pays for its time by moving an older, overlapping one to make soak.
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=20

soak: $(STAMP)  # Lightning kill/resume soak, then 200 kill -9 trials on local disk and S3 with a tally
	$(BIN)/python -m pytest -q -m slow

$(VENV)/.installed-bench: $(STAMP)  # the bench extra (matplotlib for bench/convergence.py)
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $@

bench: $(VENV)/.installed-bench
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/storage.py
	$(BIN)/python bench/compressed.py --threads 1  # a core left for the writer, as reported
	$(BIN)/python bench/convergence.py --threads 1
	$(BIN)/python bench/accelerate_loop.py --threads 1
	$(BIN)/python bench/transformers_trainer.py --threads 1  # Trainer: diffckpt vs its own saves and DCP async_save
	$(BIN)/python bench/autotune.py --threads 1
	$(BIN)/python bench/autotune.py --threads 1 --backend slow --latency 0.05
	$(BIN)/python bench/restore.py --threads 1  # restore time versus chain length, prefetch on/off
	$(BIN)/python bench/lifecycle.py --threads 1  # retention and background compaction vs training bases
	$(BIN)/python bench/sharded.py  # FSDP2 on 2 ranks: diffckpt vs torch.distributed.checkpoint

# Process start to the first training step done after a restart, plain loop and Lightning, diffckpt
# against torch.load (docs/benchmarks.md, "Restore straight into the model"): about 10 minutes at 124M
bench-first-step: $(VENV)/.installed-bench
	$(BIN)/python bench/first_step.py

# The node-local tier (docs/storage.md, "The node-local tier"): kill -9 trials, steps lost with the
# journal on and off for write_batch 1-64 on local disk and S3 (moto), and the journal's cost per step.
bench-local-tier: $(VENV)/.installed-bench
	$(BIN)/python bench/local_tier.py --threads 1  # a core left for the writer

# The writer's path of one record at GPT-2 124M size, stage by stage, against the raw bandwidth of
# /dev/shm and of the disk (docs/benchmarks.md, "The writer pipeline"): about 10 minutes, 6 GB of RAM
# and 5 GB on /dev/shm and in /var/tmp at a time.
.PHONY: bench-pipeline
bench-pipeline: $(VENV)/.installed-bench
	$(BIN)/python bench/pipeline.py

# GPT-2 124M shapes on the CPU, one training thread, 3 interleaved rounds (docs/benchmarks.md,
# "At real model sizes"): long (tens of minutes) and several GB on the temp dir's disk.
.PHONY: bench-scale
bench-scale: $(VENV)/.installed-bench
	$(BIN)/python bench/scale.py --size 124m --rounds 3 --plot docs/scale-rss-124m.png

# Fast steps emulated on the CPU (docs/benchmarks.md, "Fast steps"): the device's time a sleep, real
# GPT-2 gradients, a run root paced to 100 MB/s; then kill -9 and resume, with and without the
# node-local tier. About 17 minutes here; configurations: --config NAME:key=value,... (CheckpointOptions).
.PHONY: bench-fast-steps
bench-fast-steps: $(STAMP)
	$(BIN)/python bench/fast_steps.py
	$(BIN)/python bench/fast_steps.py --kill

# The GPU check (docs/gpu.md). On the GPU machine, with its own python3 and no network:
#   make gpu-check            (the wheels of `make gpu-wheels` in .gpu-wheels/ travel along)
# Here, or in make test: `make gpu-check DRY=1` runs every part on the CPU with tiny sizes.
GPU_PY ?= python3
ifdef DRY
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py --dry
else
gpu-check:
	$(GPU_PY) bench/gpu_check.py
endif

gpu-wheels: $(STAMP)  # here, with network: what the GPU machine's python3 lacks, for Python 3.12
	$(BIN)/python bench/gpu_check.py --fetch-wheels

clean:
	rm -rf $(VENV) build *.egg-info .gpu-site
