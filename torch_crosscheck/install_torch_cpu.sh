#!/usr/bin/env bash
# Install torch's CPU build, pinned, into the Python that runs this script (default: `python`, the active
# virtual environment's). Never the CUDA build: an unpinned `pip install torch`, or `torch==2.13.0` from
# the public index, brings a CUDA wheel of several hundred MB and the nvidia packages with it on Linux.
# The `+cpu` local version exists only on PyTorch's CPU wheel index (or as a wheel on disk), so pip can
# take nothing else for it.
#
#   1) offline first: where pip finds the wheel without an index (its find-links: a folder of wheels, set
#      in pip's config or with PIP_FIND_LINKS), install from there; torch's few pure-Python dependencies
#      come from what is installed or, failing that, from pip's configured index.
#   2) otherwise PyTorch's CPU wheel index, with a short timeout and one retry, so that a machine that
#      cannot reach it fails in seconds with pip's message, not after minutes of retrying.
#
# Usage: bash torch_crosscheck/install_torch_cpu.sh [PYTHON]
set -euo pipefail

TORCH="torch==2.13.0+cpu"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
PYTHON="${1:-python}"

if "$PYTHON" -c "import sys, torch; sys.exit(torch.__version__ != '${TORCH#torch==}')" 2>/dev/null; then
    echo "install_torch_cpu: ${TORCH#torch==} is already installed"
    exit 0
fi

# 1) a local wheel? (--dry-run --no-deps --no-index: only asks whether pip can see one, installs nothing)
if "$PYTHON" -m pip install -q --dry-run --no-deps --no-index "$TORCH" >/dev/null 2>&1; then
    echo "install_torch_cpu: $TORCH from a local wheel"
    "$PYTHON" -m pip install -q --no-index "$TORCH" 2>/dev/null || "$PYTHON" -m pip install -q "$TORCH"
else
    # 2) PyTorch's CPU index
    echo "install_torch_cpu: $TORCH from $CPU_INDEX"
    "$PYTHON" -m pip install -q --timeout 15 --retries 1 --index-url "$CPU_INDEX" "$TORCH"
fi
"$PYTHON" -W ignore -c "import torch; print('install_torch_cpu: torch', torch.__version__, 'installed')"
