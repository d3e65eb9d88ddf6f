#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test) and runs the whole suite: lint, format check, the import
# contracts (layers, no cycles: pyproject.toml's tool.importlinter), pytest.
# Fails on any failed test, and also when pytest collects no test at all (its exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if (( rc == 5 )); then
  echo "test: pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
