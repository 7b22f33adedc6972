# Everything a fresh machine needs: `make demo` runs the main job, `make test`
# runs the linter, the type checker and the test suite. Both create .venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch. Override on a GPU box, e.g. `make TORCH=torch test`.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install demo demo-quick test lint typecheck pytest bench bench-quick clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# the shared nonce store's tests start a real redis-server (Debian package; CI runs as root)
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }; } || \
		echo "no redis-server: the shared nonce store tests will skip"
	@# promtool checks deploy/prometheus/ (Debian's prometheus package ships it)
	command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }; } || \
		echo "no promtool: the Prometheus config and alert rule tests will skip"
	@# headless chromium screenshots the daemons' status pages (a slow test; Debian package)
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }; } || \
		echo "no chromium: the status page screenshot test will skip"
	touch $(STAMP)

# The main job on ddddocr's trained captcha recogniser (a few minutes; docs/demo.md);
# demo-quick: the same on the small digits classifier (about a minute).
demo: $(STAMP)
	$(BIN)/splitinfer-demo

demo-quick: $(STAMP)
	$(BIN)/splitinfer-demo --quick

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy resolves `splitinfer` through a link to the repository root (the root
# *is* the package; mypy does not follow setuptools' editable import hook).
typecheck: $(STAMP)
	@mkdir -p build/typecheck && ln -sfn ../.. build/typecheck/splitinfer
	MYPYPATH=build/typecheck $(BIN)/mypy -p splitinfer.shared -p splitinfer.serving -p splitinfer.partitioner \
		-p splitinfer.edge -p splitinfer.cloud -p splitinfer.sim -p splitinfer.models -m splitinfer.demo \
		-m splitinfer.demo_ocr -m splitinfer.demo_plots -m splitinfer.demo_digits -m splitinfer.completion \
		-m splitinfer.api

pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

# Every benchmark, one after another; writes docs/benchmarks.md and .json.
# The `bench` extra brings the peer server (LitServe); bench_cloud drives its load
# with wrk when wrk is on PATH (apt install wrk), else with aiohttp's client.
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py

bench-quick: $(BENCH_STAMP)
	$(BIN)/python bench/run_all.py --quick

clean:
	rm -rf build .mypy_cache .ruff_cache
