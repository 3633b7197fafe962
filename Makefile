# The two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create or reuse the virtualenv with the pinned dev stack, build the extension, and run.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c  # a fuzzer finding fails the target even through `| tail`
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-stamp
CFLAGS_SAN := -std=c11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CORE := csrc/validate.c csrc/builder.c csrc/commit.c csrc/reader.c csrc/load.c csrc/crc32c.c csrc/skip.c
CORE_H := csrc/frk.h csrc/layout.h csrc/internal.h
FUZZ_SECONDS ?= 60

.PHONY: demo test quick build lint ctest fuzz pytest sysdeps bench clean compat

# The dev venv: a hard-linked copy of the machine's environment for these two files (.ci/envs.py),
# installed the first time only (minutes, ~6 GB), then seconds and no disk for each clone.
$(STAMP): requirements-dev.txt constraints-dev.txt .ci/envs.py
	python3 .ci/envs.py dev $(VENV)
	touch $@

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# clang (ASan/UBSan and libFuzzer) and clang-format from Debian's packages, when they are missing.
sysdeps:
	@command -v clang >/dev/null && command -v clang-format >/dev/null && \
	  test -n "$$(find /usr/lib/llvm-*/lib/clang -name 'libclang_rt.fuzzer*' 2>/dev/null | head -1)" || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang clang-format libclang-rt-dev >/dev/null || \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang clang-format libclang-rt-14-dev >/dev/null; }

# ruff (lint and format), mypy on the package and its stub, clang-format on csrc/: all clean.
lint: $(STAMP) | sysdeps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy fastai_resume
	clang-format --dry-run -Werror csrc/*.c csrc/*.h csrc/tests/*.c

build/test_core: csrc/tests/test_core.c $(CORE) $(CORE_H) | sysdeps
	mkdir -p build
	clang $(CFLAGS_SAN) -pthread -Icsrc csrc/tests/test_core.c $(CORE) -ldl -o $@

build/fuzz_reader: csrc/tests/fuzz_reader.c $(CORE) $(CORE_H) | sysdeps
	mkdir -p build
	clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -pthread -Icsrc csrc/tests/fuzz_reader.c $(CORE) -ldl -o $@

ctest: build/test_core
	./build/test_core

fuzz: build/fuzz_reader build/test_core
	rm -rf build/fuzz-corpus && mkdir -p build/fuzz-corpus
	./build/test_core --write-seeds build/fuzz-corpus
	./build/fuzz_reader -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
	  -print_final_stats=1 build/fuzz-corpus 2>&1 | tail -n 12

PYTEST := $(PY) -m pytest -q -ra -n 2 --dist worksteal --timeout 1200

pytest: build
	$(PYTEST) --durations 40

test: build lint ctest fuzz pytest

# The inner loop while changing code: every test but those marked `slow` (2-process DDP jobs, Jupyter
# kernels, notebooks, random-kill trials, runs of many processes), which `make test` and CI still run.
quick: build
	$(PYTEST) -m "not slow"

# Every fastai release pyproject.toml claims (fastai_resume/compat.py: TESTED_FASTAI), and the oldest
# with the oldest fastcore it admits: each installed apart (pip --no-deps --target build/compat/ROW,
# first on PYTHONPATH; the shared venv is not touched), then the compat checks, an exact
# SIGKILL-and-resume, the fit wrappers, the save/load round trips and the trackers run against it.
# (--basetemp: pytest prunes all but the newest 3 temp dirs of a user, also those of a running session.)
COMPAT_ROWS ?= fastai==2.8.9 fastai==2.8.10 fastai==2.8.11 fastai==2.8.12 fastai==2.8.9+fastcore==2.2.22
COMPAT_TESTS := tests/test_compat.py tests/test_learner.py::test_round_trip_restores_model_and_optimizer_bitwise \
  tests/test_learner.py::test_vanilla_fastai_pth_still_loads_exactly_as_fastai_loads_it \
  tests/test_learner.py::test_restored_losses_are_rebuilt_on_first_read_into_a_plain_list \
  tests/test_learner.py::test_import_patches_idempotently_lazily_and_keeps_signatures \
  "tests/test_exact.py::test_kill_at_iteration_k_then_resume_is_bitwise_equal[middle-batch-middle-epoch]" \
  tests/test_exact.py::test_fit_wrappers_resume tests/test_exact.py::test_negative_control_without_the_data_order_state_the_run_differs \
  tests/test_trackers.py
compat: build
	@for row in $(COMPAT_ROWS); do \
	  dir=build/compat/$$row; pkgs="$${row//+/ }"; \
	  test -f $$dir/.done || { rm -rf $$dir && $(PY) -m pip install -q --no-deps --target $$dir $$pkgs && touch $$dir/.done; }; \
	  echo "== $$pkgs"; \
	  PYTHONPATH=$(CURDIR)/$$dir FRK_COMPAT_PKGS="$$pkgs" $(PY) -m pytest -q -p no:cacheprovider -n 0 \
	    --basetemp=build/compat/tmp $(COMPAT_TESTS) | tail -n 8; \
	done

# The wheels users install without a compiler (.ci/wheels.py, docs/install.md): the sdist, a wheel from
# it with gcc (the sdist builds), then per Python pyproject.toml claims a manylinux wheel built from it
# with zig cc against glibc 2.28, tagged what `auditwheel show` allows; fails unless each is, no
# narrower than manylinux_2_28, with the package's files only. In build/wheels/dist; kept while the
# sources are unchanged. The tools (ziglang, auditwheel) install once per machine (.ci/envs.py).
.PHONY: wheels matrix
wheels:
	python3 .ci/wheels.py

# The wheels as users get them (.ci/matrix.py): each installed by pip, with no compiler on PATH, into a
# clean venv per Python pyproject.toml claims, with the newest stack (constraints-dev.txt) and the
# oldest it claims; the format, exact-resume, CLI and compat tests run against it. Writes
# .ci/matrix.json (the README's table: python3 .ci/matrix.py --rewrite). Needs no dev venv.
matrix: wheels
	python3 .ci/matrix.py

demo: build
	$(PY) -m fastai_resume.demo

# Every benchmark writes bench/results/NAME.json; report.py turns them into the README's tables (and docs/sharded.md's).
bench: build
	$(PY) bench/io.py
	$(PY) bench/resume.py
	$(PY) bench/overhead.py
	$(PY) bench/scale.py
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_control.py
	$(PY) bench/sharded.py
	$(PY) bench/llm.py
	$(PY) bench/fsdp_lora.py
	$(PY) bench/streams.py
	$(PY) bench/everystep.py
	$(PY) bench/report.py

clean:
	rm -rf build fastai_resume/*.so *.egg-info
