#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the service on the offline configuration; extra
# arguments go to `omni-gateway start` (e.g. --port 8080).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/omni-gateway start --config configs/offline.yaml "$@"
