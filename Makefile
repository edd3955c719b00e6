# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint bench clean browser

# The editable install also compiles the C kernel and the per-call path in place (setup.py).
$(STAMP): requirements-dev.txt pyproject.toml setup.py commcheck/native/kernel.c \
		commcheck/native/hot.c commcheck/native/ccapi.h commcheck/native/express.c \
		commcheck/native/gate.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python launch/examples/demo.py

# The C++ DDP hook is built before the tests (once per node and torch version, ~1 min), as
# `commcheck run` does before training: a rank never builds it. Without a C++ toolchain the
# DDP tests use the Python hook (or skip), hence the leading "-". The suite runs in two
# parts (docs/testing.md): every file whole on one of $(WORKERS) pytest-xdist workers, then
# the `serial` tests (timing verdicts) alone; both always run, either failing fails. The
# slowest tests are listed (--durations) to keep the whole within its 15 minutes.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
test: $(STAMP) browser
	$(BIN)/ruff check .
	-$(BIN)/python -m commcheck build
	$(PYTEST) -n $(WORKERS) --dist loadfile -m "not serial" --durations=25; \
	parallel=$$?; $(PYTEST) -m serial --durations=5 && exit $$parallel

# The browser tests (the HTML report; the trace in Perfetto's UI) drive Debian's Chromium.
# Installed here when run as root with apt (CI's machines); elsewhere they skip, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  >/dev/null 2>&1; } || echo "make: no Chromium; the browser tests will skip"

# The fast set (no subprocess, no torchrun; under a minute): run it after every change.
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/torchrun --nproc-per-node 4 launch/bench/bench_overhead.py

clean:
	rm -rf $(VENV) runs build *.egg-info commcheck/native/*.so
