# The two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create or reuse the virtualenv with the pinned dev stack, build the extension, and run.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c  # a fuzzer finding fails the target even through `| tail`
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-stamp
CFLAGS_SAN := -std=c11 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CORE := csrc/validate.c csrc/builder.c csrc/commit.c csrc/reader.c csrc/crc32c.c csrc/skip.c
CORE_H := csrc/frk.h csrc/layout.h csrc/internal.h
FUZZ_SECONDS ?= 60

.PHONY: demo test build ctest fuzz pytest sysdeps bench clean

$(STAMP): requirements-dev.txt constraints-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements-dev.txt -c constraints-dev.txt
	touch $@

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# clang (ASan/UBSan and libFuzzer) from Debian's packages, when it is missing.
sysdeps:
	@command -v clang >/dev/null && test -n "$$(find /usr/lib/llvm-*/lib/clang -name 'libclang_rt.fuzzer*' 2>/dev/null | head -1)" || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev >/dev/null || \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-14-dev >/dev/null; }

build/test_core: csrc/tests/test_core.c $(CORE) $(CORE_H) | sysdeps
	mkdir -p build
	clang $(CFLAGS_SAN) -Icsrc csrc/tests/test_core.c $(CORE) -o $@

build/fuzz_reader: csrc/tests/fuzz_reader.c $(CORE) $(CORE_H) | sysdeps
	mkdir -p build
	clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Icsrc csrc/tests/fuzz_reader.c $(CORE) -o $@

ctest: build/test_core
	./build/test_core

fuzz: build/fuzz_reader build/test_core
	rm -rf build/fuzz-corpus && mkdir -p build/fuzz-corpus
	./build/test_core --write-seeds build/fuzz-corpus
	./build/fuzz_reader -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
	  -print_final_stats=1 build/fuzz-corpus 2>&1 | tail -n 12

pytest: build
	$(PY) -m pytest -q -ra -n 2 --timeout 1200

test: build ctest fuzz pytest

demo: build
	$(PY) -m fastai_resume.demo

bench: build
	$(PY) bench/io.py
	$(PY) bench/resume.py
	$(PY) bench/overhead.py
	$(PY) -m torch.distributed.run --standalone --nproc_per_node 2 bench/ddp_control.py

clean:
	rm -rf build fastai_resume/*.so *.egg-info
