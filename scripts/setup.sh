#!/usr/bin/env bash
# Sets up a fresh machine for this project: system packages (Java 17 for Spark,
# PostgreSQL server binaries for the tests) when missing and running as root, then the
# virtual environment in .venv with the project installed editable with every extra.
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
if ! command -v java >/dev/null 2>&1; then need_apt+=(openjdk-17-jre-headless); fi
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  need_apt+=(postgresql postgresql-contrib)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ]; then
    echo "setup: installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "setup: missing system packages (${need_apt[*]}); install them (e.g. sudo apt-get install ${need_apt[*]}) and re-run" >&2
    exit 1
  fi
fi

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)'; then
  echo "setup: Python 3.11 or 3.12 is required (found $("$PY" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi

stamp=.venv/.installed-$(cat pyproject.toml setup.py persist_lib/ingest/kafka/_split.c | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PY" -m venv .venv
  fi
  echo "setup: installing the project and its dependencies into .venv (a few minutes the first time)"
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
