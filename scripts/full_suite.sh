#!/usr/bin/env bash
# The full tier: the README's suite and the tests marked `full` (pyproject.toml), which it
# leaves out to keep to 3 minutes. Run it before a change to what they cover lands (the
# tiles' build, Triton's passes, the compile matrix, a model family).
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNGRAD_FULL=1 python -m pytest -q -n "${WORKERS:-2}" "$@"
