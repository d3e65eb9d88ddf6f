#!/usr/bin/env bash
# Packs everything the GPU run needs on the lent H200 machine beyond its own image: vLLM 0.26.0
# and the gateway's media stack (requirements-h200.txt beside this script), installed as a tree
# for Python 3.12, compressed and split into pieces small enough to send one at a time; and the
# shm C extension built for CPython 3.12 (the machine's python3), next to the cp311 one. gzip -1,
# not xz: on 2 busy cores xz -6 took over 20 minutes for 1.4 GB; gzip -1 takes about one and
# makes 10 pieces instead of 6, each a few seconds to send.
# Usage: loadtest/gpu/pack.sh OUT_DIR [CHUNK_MiB]   (OUT_DIR inside the checkout, ignored by git;
# CHUNK_MiB = 64 minus the size of everything else sent with a piece, the checkout itself
# included (about 6 MiB): default 54).
# PY312 names a CPython 3.12 (its headers) to build the extension for (default: python3.12).
# BUNDLED names bundled models (stages/backends/bundled.py) fetched here to travel too, e.g.
# BUNDLED="smart-turn-v3.2 silero-vad smollm2-135m-instruct whisper-tiny.en-transformers
# piper-en_US-joe-medium" for the turn-taking run; they land in /tmp/omni-cache/models there,
# the OMNI_GATEWAY_CACHE device-run.sh sets. OMNI=1 adds vLLM-Omni (requirements-omni.txt) as
# /tmp/omnisite there, for loadtest.omni_anchor.
set -euo pipefail
out=${1:?usage: pack.sh OUT_DIR [CHUNK_MiB]}
chunk=${2:-54}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
py312=${PY312:-python3.12}
if ! "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "pack.sh: $py312 is not a working CPython 3.12 (the GPU machine's Python, which the" \
         "shm extension is built for): set PY312 to one" >&2
    exit 1
fi
mkdir -p "$out" "$work/w"
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for v in 31 28 27 26 24 17 12 5; do target+=(--platform "manylinux_2_${v}_x86_64"); done
target+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps "${target[@]}" -d "$work/w" -r "$here/requirements-h200.txt"
# opuslib (the gateway's Opus at the pipeline's rates) is pure Python but published as an
# sdist only: built into a wheel here. It loads the libopus of PyAV's wheel there.
python3 -m pip wheel -q --no-deps -w "$work/w" opuslib==3.0.1
python3 -m pip install -q --no-index --no-deps --no-compile "${target[@]}" --target "$work/vpsite" "$work"/w/*.whl
members=(vpsite)
if [ -n "${OMNI:-}" ]; then
    # vLLM-Omni for loadtest.omni_anchor, in a tree of its own (requirements-omni.txt says why);
    # openai-whisper, one of its requirements, is published as an sdist only
    mkdir -p "$work/wo"
    python3 -m pip download -q --no-deps "${target[@]}" -d "$work/wo" -r "$here/requirements-omni.txt"
    python3 -m pip wheel -q --no-deps -w "$work/wo" openai-whisper==20250625
    python3 -m pip install -q --no-index --no-deps --no-compile "${target[@]}" --target "$work/omnisite" "$work"/wo/*.whl
    members+=(omnisite)
fi
if [ -n "${BUNDLED:-}" ]; then
    cache=${OMNI_GATEWAY_CACHE:-$HOME/.cache/omni-gateway}
    mkdir -p "$work/omni-cache/models"
    for name in $BUNDLED; do
        if [ ! -f "$cache/models/$name/.omni-gateway-build-complete" ]; then
            echo "pack.sh: bundled model $name is not built in $cache/models: run" \
                 "\`omni-gateway models fetch $name\` first" >&2
            exit 1
        fi
        cp -a "$cache/models/$name" "$work/omni-cache/models/"
    done
    members+=(omni-cache)
fi
tar -C "$work" -cf - "${members[@]}" | gzip -1 > "$work/vp.tar.gz"
rm -f "$out"/p?? "$out"/SUMS
split -b "${chunk}M" -d -a 2 "$work/vp.tar.gz" "$out/p"
(cd "$out" && sha256sum p?? > SUMS)
cp "$here/device-start.sh" "$here/device-env.sh" "$out/"
# the C ring for the machine's Python 3.12, with the flags of setup.py (lands in shm/, ignored
# by git: carry it); gcc directly, so that Python 3.12 needs no setuptools
include=$("$py312" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
gcc -shared -fPIC -O2 -std=gnu11 -Wall -Wextra -Wno-unused-parameter \
    -Wno-missing-field-initializers -I"$include" "$repo"/shm/src/ring.c "$repo"/shm/src/_ring.c \
    -lrt -o "$repo/shm/_ring.cpython-312-x86_64-linux-gnu.so"
ls -la "$out" "$repo"/shm/_ring.cpython-312-*.so
