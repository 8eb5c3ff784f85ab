# Two commands: `make run` (install, prepare the built-in corpus, train `tiny`,
# checkpoint, print a sample) and `make test` (install, check the import layering, build the manual strictly, run the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch first, pinned: the CPU build lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: install run test bench clean prometheus docs

# Every trainer process (each torchrun rank of each multi-process test) would otherwise compile
# trainforge's sources again (~0.35 s of CPU per process) where the environment disables .pyc files.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

# The C++ CPU kernels, built once here (a line says how long it took), so no later command pays
# for the build; again when their sources change. Without a compiler it prints one line and
# trainforge runs on the fallback kernels.
KERNELS := $(wildcard src/trainforge/infer/cpu_kernels/*.cpp src/trainforge/infer/cpu_kernels/*.h) \
           src/trainforge/infer/cpu_kernels/build.py
$(BIN)/.kernels: $(BIN)/.installed $(KERNELS)
	$(BIN)/python -m trainforge.infer.cpu_kernels
	touch $@

install: $(BIN)/.installed $(BIN)/.kernels

run: install
	$(BIN)/trainforge train

# Prometheus + promtool unpacked into .prometheus/ for the monitoring end-to-end test
# (skipped, with the reason, when the package cannot be downloaded).
prometheus:
	bash .ci/fetch_prometheus.sh

# lint-imports first: a broken layering contract ([tool.importlinter] in pyproject.toml) fails in a second;
# then the manual (mkdocs.yml, strict: a broken link or anchor, or a page missing from the nav, fails; a few seconds).
# The single-process tests run on one pytest-xdist worker per core (one thread each, tests/conftest.py),
# whole files per worker so module fixtures are built once; the multi-process ones (marked slow) then
# run one at a time, each already using every core.
test: install prometheus
	$(BIN)/lint-imports --no-cache --no-logo
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not slow" --durations=20
	$(BIN)/python -m pytest -q -m slow --durations=40

# The user manual (docs/, mkdocs.yml) as a static site in site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .prometheus
