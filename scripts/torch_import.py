"""torch, where a script compares with it: tinyattn_np never needs it, and a script without it says the one
line that installs its CPU build (TORCH_INSTALL_HINT, the only place that line is written)."""

from __future__ import annotations

import os
from typing import Any

import outputs

TORCH_INSTALL_HINT = "bash torch_crosscheck/install_torch_cpu.sh"  # torch 2.13.0+cpu, never the CUDA build


def load_torch(threads: int | None = None, flag: str = "--torch") -> tuple[Any, Any]:
    """(torch, torch.nn.functional) on `threads` threads (default: every core); where torch is missing, the
    install line and exit 2 (outputs.needs: every script's rule for a missing optional package)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        outputs.needs(f"{flag} needs torch; install its CPU build with: {TORCH_INSTALL_HINT}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return torch, F


def optional_torch() -> Any:
    """torch where it is installed, else None (tinyattn_np never needs it; a demo uses it as a witness)."""
    try:
        import torch
    except ImportError:
        return None
    return torch
