#!/usr/bin/env bash
# On the GPU machine, from the repository root, once device-env.sh's pieces are all there:
#   bash loadtest/gpu/device-run.sh start [gpu_run args...]   start the run in the background
#     (MODULE=loadtest.gateway_scaling runs that benchmark instead of loadtest.gpu_run)
#   bash loadtest/gpu/device-run.sh wait SECONDS              wait for it, copy results to $OUT
# The run outlives one command (its own process session), so a run longer than a command's
# limit is followed by further `wait` commands; results.json is rewritten after each layout.
set -u
run=/tmp/gpu-run
case "${1:?usage: device-run.sh start [args] | wait SECONDS}" in
start)
    shift
    source /tmp/vp/device-env.sh || exit
    mkdir -p "$run"
    export PYTHONPATH="$PWD:$PYTHONPATH" OMNI_GATEWAY_CACHE=/tmp/omni-cache
    python3 -c 'import torch, vllm, aiortc, av, webrtcvad, espeakng_loader, shm._ring; print("imports ok: torch", torch.__version__, "vllm", vllm.__version__, "gpus", torch.cuda.device_count())' || exit
    setsid nohup python3 -m "${MODULE:-loadtest.gpu_run}" --out "$run" "$@" > "$run/run.log" 2>&1 < /dev/null &
    echo $! > "$run/pid"
    echo "${MODULE:-loadtest.gpu_run} started (pid $(cat "$run/pid"))"
    ;;
wait)
    deadline=$(( $(date +%s) + ${2:-500} ))
    while kill -0 "$(cat "$run/pid")" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 2; done
    if kill -0 "$(cat "$run/pid")" 2>/dev/null; then echo "run still running"; else echo "run finished"; fi
    grep -E '^\[|^\|' "$run/run.log" | tail -n 60
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    if [ -n "${OUT:-}" ]; then
        cp "$run"/results.json "$run"/table.md "$OUT"/ 2>/dev/null
        # loadtest.omni_anchor's own run of ours, rewritten after each layout
        cp "$run"/ours/results.json "$OUT"/ours-results.json 2>/dev/null
        tail -c 8000000 "$run/run.log" > "$OUT/run.log"
        # loadtest.omni_anchor's server log: what failed inside vLLM-Omni is only there
        [ -f "$run/vllm-omni.log" ] && tail -c 8000000 "$run/vllm-omni.log" > "$OUT/vllm-omni.log"
    fi
    ;;
esac
