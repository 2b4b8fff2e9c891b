# Two commands set everything up: 'make demo' and 'make test'. Both create .venv and install
# the project on first use; later runs skip the install until pyproject.toml changes. Both
# then run ops/dev-services.sh up: RabbitMQ and Redis answer afterwards (used as found, else
# started with Docker, else installed with apt-get as root and started locally).
# Recipes call .venv/bin/... directly: no activated venv is needed or used.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_TASKS ?= 10
# Tests run in this many processes (pytest-xdist), a file per process at a time: most of a test's
# time is spent waiting on the broker, so 3 processes on 2 cores take about half the time of one.
# Every test already uses its own queues, keys and private servers, as two runs side by side do.
TEST_WORKERS ?= 3

.DEFAULT_GOAL := help
.PHONY: help venv install lock test-slow test-ends tools tools-mermaid test lint format docs-code demo drill bench bench-own-cost bench-outbox bench-postgres-outbox bench-sync-client bench-notify \
	bench-stream bench-priority bench-limits bench-token-budget bench-fair-share bench-task-index bench-console bench-rss bench-redis-client \
	bench-start bench-io-high bench-waiters bench-workflows bench-steps compose-check clean \
	distclean docs docs-serve console-screenshots services-up services-down services-status soak fuzz

help:
	@echo "make demo           install, start RabbitMQ + Redis if needed, run the end-to-end demo (DEMO_TASKS=$(DEMO_TASKS) tasks)"
	@echo "make test           install, start RabbitMQ + Redis if needed, lint (ruff, mypy), run every test"
	@echo "make test-slow      the tests marked slow that 'make test' leaves out (kill drills of workflows and schedules, ...); CI runs them"
	@echo "make test-ends      the unit and core integration tests at the lowest and the newest versions pyproject.toml allows"
	@echo "make services-up    make RabbitMQ + Redis answer (ops/dev-services.sh up; demo and test run it)"
	@echo "make services-down  stop what services-up started (never a server it found running)"
	@echo "make services-status  what answers, and what services-up started"
	@echo "make install        create .venv and pip install -e '.[dev]' at the locked versions (skipped when up to date)"
	@echo "make lock           resolve the newest versions pyproject.toml allows into requirements/dev.lock"
	@echo "make tools          install promtool and Chromium + its driver (as root with apt-get), fetch mermaid.js (npm) for the tests"
	@echo "make lint           ruff check, ruff format --check, mypy, the import layers (lint-imports)"
	@echo "make format         ruff format and ruff check --fix"
	@echo "make drill          every fault drill (private RabbitMQ nodes, 3-node cluster) and its table"
	@echo "make bench          benchmark vs raw aio-pika, FastStream, Dramatiq (own venv; BENCH_ARGS=--smoke)"
	@echo "make bench-own-cost weclaw_mq's own CPU per delivery, in isolation (no broker, no Redis)"
	@echo "make bench-outbox   the local outbox: publish with the broker down, the relay's drain rate"
	@echo "make soak           50,000 tasks through one worker: its RSS stays within 10 % after warm-up"
	@echo "make fuzz           the hostile-input tests with many more, random examples (FUZZ_EXAMPLES=20)"
	@echo "make bench-notify   what notify=True costs a worker (tasks/s, CPU per task; real broker)"
	@echo "make bench-stream   ctx.emit's cost in the handler, and emit -> App.stream reader latency"
	@echo "make bench-priority URGENT behind a NORMAL backlog, and the throughput cost of priority lanes"
	@echo "make bench-limits   what a per-key limit costs the guarded consume path (c=10, c=100)"
	@echo "make bench-token-budget  goodput and 429s against a provider with real token limits, budgeted vs not"
	@echo "make bench-fair-share  another tenant's task behind a 2,000-task backlog, fair share on vs off; its cost"
	@echo "make bench-task-index  the task index: consume cost on vs off; list_tasks over 1,000,000"
	@echo "make bench-console  the web console: server time of a Tasks page over 1,000,000 tasks; 20 open overviews vs 1"
	@echo "make bench-rss      a worker's RSS by import layer (what each dependency adds)"
	@echo "make bench-start    a cold worker's time to first delivery, 1 and 2 processes"
	@echo "make bench-io-high  the I/O-bound case at 512 and 2,000 in flight (guard on and off)"
	@echo "make bench-redis-client  the store's Redis calls alone vs auto-pipelined (and hiredis if installed)"
	@echo "make bench-waiters  10,000 result() waiters in one process: connections, memory, publish latency"
	@echo "make bench-workflows a 3-stage chain vs three stages chained by hand; a 1,000-part group's fan-in"
	@echo "make bench-steps    a memoized step's round trips and CPU, fresh and replayed; a long run's publishes"
	@echo "make docs           build the documentation site into site/ (mkdocs build --strict)"
	@echo "make docs-serve     serve the site at http://127.0.0.1:8000/, rebuilt on every save"
	@echo "make console-screenshots  photograph the web console's pages into docs/assets/console/ (broker, Redis, Chromium)"
	@echo "make compose-check  validate docker-compose.yml (skipped without docker-compose)"
	@echo "make clean          remove caches and build output; 'make distclean' also removes .venv"

venv: $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(STAMP)

# The stamp records a finished install; pip runs again only when pyproject.toml or the lock is
# newer. The lock pins every package the tests and linters run on (requirements/dev.lock).
LOCK := requirements/dev.lock
$(STAMP): pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -m pip install --disable-pip-version-check -q -c $(LOCK) -e '.[dev]'
	@touch $@

# A new lock: the newest versions pyproject.toml's ranges allow, resolved in a fresh venv. Run
# it on purpose, then 'make test' on the result, and commit both together.
lock:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	"$$tmp/venv/bin/python" -m pip install --disable-pip-version-check -q -e '.[dev]' && \
	{ sed -n '1,/^# Made by/p' $(LOCK); \
	  "$$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^weclaw'; } > "$$tmp/lock" && \
	mv "$$tmp/lock" $(LOCK) && echo "$(LOCK) written: review 'git diff $(LOCK)', then make test"

# promtool (Debian's prometheus package) checks ops/prometheus/alerts.yml in the tests, and the
# example web page's test drives headless Chromium through its Debian driver (never a
# downloaded browser). As root with apt-get (a fresh machine, CI) they are installed here;
# elsewhere we say how.
tools: tools-mermaid
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing:$$missing (apt-get)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends $$missing >/dev/null; \
		else \
			echo "make test needs:$$missing (Debian packages: 'apt-get install$$missing' as root)"; \
			exit 1; \
		fi; \
	fi

# mermaid.js for the docs site: docs/site_files.py copies it into the built site, so its
# diagrams render offline (mkdocs-material would load it from unpkg.com when viewed) and the
# docs test can check in Chromium that they do. Fetched once per version from the npm
# registry (npm pack checks the tarball's integrity; npm itself is installed as root with
# apt-get, like the tools above, else we say how); kept in .tools/, never committed.
MERMAID_VERSION ?= 11.12.1
MERMAID_DIR := .tools/mermaid

tools-mermaid:
	@if [ "$$(cat $(MERMAID_DIR)/VERSION 2>/dev/null)" != "$(MERMAID_VERSION)" ]; then \
		if ! command -v npm >/dev/null 2>&1; then \
			if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
				echo "installing: npm (apt-get), to fetch mermaid.js"; \
				apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
					--no-install-recommends npm >/dev/null || exit 1; \
			else \
				echo "the docs need mermaid.js from the npm registry, and npm is missing:" \
					"install it (Debian: 'apt-get install npm' as root), then run 'make tools' again"; \
				exit 1; \
			fi; \
		fi; \
		tmp=$$(mktemp -d); \
		if (cd $$tmp && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null) && \
			tar -xzf $$tmp/mermaid-$(MERMAID_VERSION).tgz -C $$tmp package/dist/mermaid.min.js package/LICENSE; then \
			mkdir -p $(MERMAID_DIR) && mv $$tmp/package/dist/mermaid.min.js $$tmp/package/LICENSE $(MERMAID_DIR)/ && \
			echo $(MERMAID_VERSION) > $(MERMAID_DIR)/VERSION && rm -rf $$tmp && \
			echo "mermaid.js $(MERMAID_VERSION) is in $(MERMAID_DIR)/"; \
		else \
			rm -rf $$tmp; echo "npm pack mermaid@$(MERMAID_VERSION) failed (see above)"; exit 1; \
		fi; \
	fi

# Every check runs, whatever an earlier one found: the recipe reports each failure, then fails.
LINT_CHECKS := \
	"$(BIN)/ruff check ." \
	"$(BIN)/ruff format --check ." \
	"$(BIN)/mypy" \
	"$(BIN)/mypy consumers producers docs/hooks.py docs/inline_code.py docs/examples" \
	"$(BIN)/lint-imports --no-cache"
lint: install
	@failed=""; \
	for check in $(LINT_CHECKS); do \
		echo "$$check"; $$check || failed="$$failed\n  $$check"; \
	done; \
	if [ -n "$$failed" ]; then printf "make lint: these checks failed:$$failed\n"; exit 1; fi

# Copy the example sections into the how-to and tutorial pages again (docs/inline_code.py).
docs-code: install
	$(BIN)/python -m docs.inline_code

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Lint and tests both run, so one failure does not hide the other; the recipe fails if
# either did. pytest runs last so its summary line closes the output.
test: install tools
	@ops/dev-services.sh up
	@status=0; \
	$(MAKE) --no-print-directory lint || status=1; \
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" tests || status=1; \
	if [ $$status -ne 0 ]; then echo "make test: FAILED (see lint and pytest output above)"; fi; \
	exit $$status

# The tests marked slow (a minute or more each: the workflow and schedule kill drills, the
# guarded recovery race, the crash loop through the delay queue, the benchmark's smoke run),
# two at a time: each uses its own private nodes, queues and keys. CI runs it after 'make test'.
test-slow: install tools
	@ops/dev-services.sh up
	$(BIN)/pytest -q -n 2 --dist load -m slow -rfE tests

# The ranges in pyproject.toml at both ends (tests/dependency_ends.sh): the lowest versions
# they allow, then the newest. CI runs the lowest end; the newest end only warns there, since
# a release upstream must not turn a landed commit red (fix it, then 'make lock').
test-ends: install
	@ops/dev-services.sh up
	@status=0; \
	for end in lowest newest; do \
		tests/dependency_ends.sh $$end || { echo "make test-ends: the $$end end failed"; status=1; }; \
	done; \
	exit $$status

demo: install
	@ops/dev-services.sh up
	$(BIN)/python -m consumers.demo_run $(DEMO_TASKS)

# RabbitMQ and Redis on WECLAW_MQ_AMQP_URL / WECLAW_MQ_REDIS_URL: 'up' uses what answers and
# starts what does not; 'down' stops only what 'up' started (recorded in .dev-services/).
services-up:
	@ops/dev-services.sh up

services-down:
	@ops/dev-services.sh down

services-status:
	@ops/dev-services.sh status

drill: install
	tests/drills/run_drills.sh $(DRILL_ARGS)

# The peers live in benchmarks/.venv, built by run.sh on first use, never in .venv.
bench:
	PYTHON=$(PYTHON) benchmarks/run.sh $(BENCH_ARGS)
	$(MAKE) --no-print-directory bench-outbox
	$(MAKE) --no-print-directory bench-postgres-outbox
	$(MAKE) --no-print-directory bench-sync-client
	$(MAKE) --no-print-directory bench-redis-client
	$(MAKE) --no-print-directory bench-start
	$(MAKE) --no-print-directory bench-io-high
	$(MAKE) --no-print-directory bench-waiters
	$(MAKE) --no-print-directory bench-token-budget
	$(MAKE) --no-print-directory bench-fair-share
	$(MAKE) --no-print-directory bench-console
	$(MAKE) --no-print-directory bench-workflows

# The local outbox: publish into it (broker down), the relay's drain rate beside a confirmed
# publish and publish_many (target: drain >= 0.8x publish_many). ~15 s.
bench-outbox: install
	$(BIN)/python -m benchmarks.outbox $(OUTBOX_BENCH_ARGS)

# The PostgreSQL outbox (docs/how-to/outbox.md): the INSERT's cost to the user's transaction,
# commit -> confirm p50/p99 with LISTEN/NOTIFY (target p99 < 50 ms), drain rate of 1 and 3 relays.
bench-postgres-outbox: install
	$(BIN)/python -m benchmarks.postgres_outbox $(PG_OUTBOX_BENCH_ARGS)

# app.sync.publish from 8 threads against async publish at the same concurrency (target >= 0.8x).
bench-sync-client: install
	$(BIN)/python -m benchmarks.sync_client $(SYNC_BENCH_ARGS)

# docs/design/performance.md, "own work per delivery": process() against a bare handler call (needs only
# the project's .venv). OWN_COST_ARGS="--n 20000 --rounds 5" are the defaults.
# The store's Redis path in isolation (~20 s): CPU per command alone vs auto-pipelined, with
# redis-py's parser and hiredis when installed (.venv/bin/pip install hiredis to compare).
bench-redis-client: install
	$(BIN)/python -m benchmarks.redis_client $(REDIS_CLIENT_BENCH_ARGS)

# spawn -> first handler start of 'weclaw-mq worker', 1 and 2 processes (docs/operations/workers-and-cli.md).
bench-start: install
	@# with bytecode, as a deployed worker has it (see benchmarks/run.sh)
	@$(BIN)/python -m compileall -q weclaw_mq benchmarks >/dev/null
	$(BIN)/python -m benchmarks.start_time $(START_BENCH_ARGS)

# The I/O-bound case at 512 and 2,000 in flight: raw, guard off, guard on (a few minutes;
# IO_HIGH_ARGS=--smoke for 512 only, tiny). Peers are not in it: the project's .venv serves.
bench-io-high: install
	$(BIN)/python -m benchmarks.bench --cases io-high --skip-peers --repeats 3 \
		--out benchmarks/results/io-high $(IO_HIGH_ARGS)

# 10,000 result() waiters in one process (~30 s): the Redis connections they use, memory per
# waiter, publish and status() latency meanwhile. WAITERS_BENCH_ARGS=--smoke for tiny counts.
bench-waiters: install
	$(BIN)/python -m benchmarks.waiters $(WAITERS_BENCH_ARGS)

# Workflows (~1 min): a 3-stage chain against three stages chained by hand (target <= 1.2x), a
# 1,000-part group's fan-in rate against plain guarded tasks, and the join step alone.
# WORKFLOWS_BENCH_ARGS="--chains 300 --parts 1000 --joins 10000 --rounds 3" are the defaults.
bench-workflows: install
	$(BIN)/python -m benchmarks.workflows $(WORKFLOWS_BENCH_ARGS)

bench-rss: install
	@# with bytecode, as a deployed worker has it (see benchmarks/run.sh)
	@$(BIN)/python -m compileall -q weclaw_mq >/dev/null
	$(BIN)/python -m benchmarks.rss_layers

bench-own-cost: install
	$(BIN)/python -m benchmarks.own_cost $(OWN_COST_ARGS)

# Result notifications' cost: the same guarded handler with and without notify=True, on the
# shared broker and Redis. NOTIFY_ARGS="--n 2000 --rounds 3 --concurrency 10" are the defaults.
bench-notify: install
	$(BIN)/python -m benchmarks.notify_cost $(NOTIFY_ARGS)
# Streamed partial output: ctx.emit of 200 chunks (<= 5 ms in the handler) and emit -> reader
# (<= 10 ms, median and p95), on the broker and Redis; 'make bench' runs it too.
bench-stream: install
	$(BIN)/python -m benchmarks.stream_cost $(STREAM_BENCH_ARGS)
# URGENT behind 1000 NORMAL tasks, and lanes against one queue at concurrency 10 and 100 (the
# docs/how-to/priorities.md); also run by 'make bench' (benchmarks/run.sh). PRIORITY_ARGS=--smoke.
bench-priority: install
	$(BIN)/python -m benchmarks.priority $(PRIORITY_ARGS)

# A per-key limit's cost: the guarded handler alone and with a concurrency limit that never
# defers (target: >= 0.90x the throughput of guard alone). ~60 s quiet, 2 min loaded.
# LIMITS_ARGS="--n 2000 --rounds 3 --concurrency 10 100 --variants guard concurrency" are the
# defaults; add "rate" to --variants for a rate limit too.
bench-limits: install
	$(BIN)/python -m benchmarks.limits_cost $(LIMITS_ARGS)

# Token limits against a local provider with its own token limit (weclaw_mq.testing.fake_provider):
# 429s and goodput, budgeted vs not, 3 workers (~90 s). TOKEN_BUDGET_ARGS=--smoke for tiny.
bench-token-budget: install
	$(BIN)/python -m benchmarks.token_budget $(TOKEN_BUDGET_ARGS)

# Fair share (issue 31): a new tenant's task behind 2,000 tasks of others (target: within
# C + 1 completions), and what fair share costs the consume and publish paths. ~3 min.
bench-fair-share: install
	$(BIN)/python -m benchmarks.fair_share $(FAIR_SHARE_ARGS)

# The task index (issue 29): the guarded consume path with WECLAW_MQ_TASK_INDEX on vs off
# (target: on / off >= 0.95), and a page of list_tasks over 1,000,000 indexed tasks on a
# redis-server of its own (target: < 100 ms); also run by 'make bench'. TASK_INDEX_ARGS=--smoke.
bench-task-index: install
	$(BIN)/python -m benchmarks.task_index_cost $(TASK_INDEX_ARGS)

# Durable work (issue 40, ~1 min): a memoized step's Redis round trips (counted; target <= 1 per
# fresh step beyond its attempt's one read, 0 per replay) and CPU (target <= 30 us), fresh,
# replayed and in a worker; a long run's publishes (target <= T / period + 2). A missed count
# fails it; also run by 'make bench' (benchmarks/run.sh). STEPS_BENCH_ARGS=--smoke for tiny.
bench-steps: install
	$(BIN)/python -m benchmarks.step_cost $(STEPS_BENCH_ARGS)

# The web console's Tasks page over a big index (its own redis-server): a page of 50 out of
# 1,000,000, server time, beside App.tasks alone (target < 100 ms). CONSOLE_BENCH_ARGS="--smoke".
bench-console: install
	$(BIN)/python -m benchmarks.console_page $(CONSOLE_BENCH_ARGS)

# Not in 'make test' (minutes): a worker's memory over 50,000 tasks, guard and results on, some
# retried, some dead-lettered (benchmarks/soak.py). SOAK_ARGS="--tasks 50000 --warmup 10000".
soak: install
	@ops/dev-services.sh up
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)

# The hostile-input tests of 'make test' draw the same examples every run; this draws
# FUZZ_EXAMPLES times as many, new ones each run.
FUZZ_EXAMPLES ?= 20
fuzz: install
	@ops/dev-services.sh up
	WECLAW_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) WECLAW_FUZZ_RANDOM=1 $(BIN)/pytest -q -p no:cacheprovider \
		tests/unit/test_hostile_input.py tests/integration/test_hostile_input.py

# The CLI, configuration and task-state pages are generated from the code by docs/hooks.py;
# --strict turns every warning (a broken link, a docstring that does not resolve) into a failure.
docs: install
	$(BIN)/mkdocs build --strict -d site

docs-serve: install
	$(BIN)/mkdocs serve

# The web console's pictures in docs/operations/console.md, taken in headless Chromium against
# the real broker and Redis with a worker running (docs/console_screenshots.py).
console-screenshots: install
	$(BIN)/python docs/console_screenshots.py

compose-check:
	@if command -v docker-compose >/dev/null 2>&1; then \
		echo "docker-compose -f docker-compose.yml config -q"; \
		docker-compose -f docker-compose.yml config -q && echo "docker-compose.yml is valid"; \
	else \
		echo "compose-check skipped: docker-compose is not installed"; \
	fi

clean:
	rm -rf .mypy_cache .ruff_cache .pytest_cache build dist site *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) .venv-ends .tools
