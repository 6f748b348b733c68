#!/usr/bin/env bash
# The CUDA side of torch_crosscheck in one go, for a machine with an NVIDIA GPU and a CUDA build of torch:
# the tests, the report (one row per SDPA kernel), and gpu_scaling.py at the article's shape (4 heads x 64,
# up to 262,144 tokens), with an 8 GiB cap (the article's 8 GB card), and at 32 heads x 128 (up to 131,072).
# About three minutes on one H200 (each step has a time limit: 10 minutes at most in all). Every step's
# output goes to LOG_DIR/<step>.log, its exit status and seconds to LOG_DIR/exit_codes.txt; a failing step
# does not stop the next.
#
#     bash torch_crosscheck/run_on_gpu.sh LOG_DIR
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
    echo "usage: bash torch_crosscheck/run_on_gpu.sh LOG_DIR   (LOG_DIR is created if missing)" >&2
    exit 2
fi
logs=$1
mkdir -p "$logs" || exit 2
: > "$logs/exit_codes.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tree under test, installed or not
python=$(command -v python || command -v python3) || { echo "no python on PATH" >&2; exit 1; }

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "torch sees no CUDA GPU here: nothing to run (python -c 'import torch; print(torch.cuda.is_available())')" >&2
    exit 1
fi

# step NAME SECONDS COMMAND...: run COMMAND with a time limit, log it, record its exit status
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    local status=$?
    echo "$name $status $((SECONDS - start))s" >> "$logs/exit_codes.txt"
    tail -n 3 "$logs/$name.log"
}

step machine 30 "$python" -c "import platform, numpy, torch; print(platform.platform(), platform.python_version()); \
print('numpy', numpy.__version__, '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| cuDNN', \
torch.backends.cudnn.version(), '|', torch.cuda.get_device_name(0), '| CPU threads', torch.get_num_threads())"
step pytest 150 "$python" -m pytest torch_crosscheck -q -ra -p no:cacheprovider
step report 120 "$python" torch_crosscheck/report.py
step gpu_scaling_4x64 120 "$python" torch_crosscheck/gpu_scaling.py --max-tokens 262144
step gpu_scaling_4x64_8gib 60 "$python" torch_crosscheck/gpu_scaling.py --memory-limit-gib 8
step gpu_scaling_32x128 120 "$python" torch_crosscheck/gpu_scaling.py --heads 32 --head-dim 128 --max-tokens 131072

echo "== exit codes (step, status, seconds):"
cat "$logs/exit_codes.txt"
