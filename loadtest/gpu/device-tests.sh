#!/usr/bin/env bash
# On the GPU machine, from a copy of the checkout, once device-env.sh's pieces are all there:
#   bash loadtest/gpu/device-tests.sh WHEELS -m pytest tests/gateway/test_call_e2e.py -s
#   bash loadtest/gpu/device-tests.sh WHEELS -m loadtest.ring_bench
# installs the test requirements from the wheels in WHEELS (test-requirements-h200.txt, plus
# opuslib) into /tmp/testdeps, then runs `python3 ARGS...` with them; the output goes to
# $OUT/device-tests.log too. The machine has no espeak-ng or sox: the speech recordings the
# tests use must come made, in .cache/test-speech (carry it: tests/conftest.py keeps every
# recording it makes there).
set -u
wheels=${1:?usage: device-tests.sh WHEELS PYTHON_ARGS...}
shift
source /tmp/vp/device-env.sh || exit
deps=/tmp/testdeps
if [ ! -f "$deps/.done" ]; then
    mkdir -p "$deps"
    for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$deps" || exit; done
    touch "$deps/.done"
fi
# the machine's own packages first: the wheels only add what it lacks
export PYTHONPATH="$PWD:$PYTHONPATH:$deps" OMNI_GATEWAY_CACHE=/tmp/omni-cache
python3 "$@" 2>&1 | tee "${OUT:-/tmp}/device-tests.log"
exit "${PIPESTATUS[0]}"
