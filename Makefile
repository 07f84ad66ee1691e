# Quick start: `make demo` runs the main job on the embedded default; `make test` runs the tests.
# Both set up the machine first (system packages when missing, .venv, the project).
PY := .venv/bin/python
PYTEST_ARGS ?=
SEEDS ?= 200
N ?= 20

.PHONY: setup demo screenshots test test-long test-races mutate lint typecheck bench bench-full bench-spark clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) scripts/run_pipeline.py

# After `make demo` (needs Chromium: apt-get install -y chromium); see docs/dagster.md.
screenshots: setup
	$(PY) scripts/screenshots.py

# Two workers (pytest-xdist), each starting its own Postgres, moto S3, Kafka and Spark.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-long: setup
	SEEDS=$(SEEDS) $(PY) -m pytest -m slow -q $(PYTEST_ARGS)

test-races: setup
	N=$(N) bash scripts/loop_race_tests.sh

# Mutation testing of the pure core modules against their fast tests ([tool.mutmut] in
# pyproject.toml; about 15 minutes on 2 cores). Prints the score and the survivors;
# docs/reliability.md ("Mutation testing") lists the survivors and why each is left.
MUTATE_CHILDREN ?= 2
mutate: setup
	rm -rf mutants
	.venv/bin/mutmut run --max-children $(MUTATE_CHILDREN)
	$(PY) scripts/mutation_score.py

lint: setup
	.venv/bin/ruff check persist_lib dagster_project jobs sensors bench tests
	.venv/bin/mypy
	.venv/bin/lint-imports --no-cache

bench: setup
	$(PY) -m bench --quick

bench-full: setup
	$(PY) -m bench --full

# Spark scaling: in-process, local[1], local[2], a standalone cluster of 1 and 2 workers.
bench-spark: setup
	$(PY) -m bench.spark_scaling --out bench/out/spark_scaling.json

clean:
	rm -rf .persist .dagster_home .demo bench/out .pytest_cache .mypy_cache .ruff_cache mutants
