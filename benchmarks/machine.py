"""What the benchmarks record about the machine they ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def git_commit() -> str:
    """HEAD of this checkout, marked when the tree differs from it (the
    installed mltuner may differ too: ``pip install .`` rebuilds it)."""
    def git(*args: str) -> Optional[str]:
        try:
            proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def gpu_names() -> list[str]:
    """Each NVIDIA GPU's name and driver version; empty without one."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()] if proc.returncode == 0 else []
