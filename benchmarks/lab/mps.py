"""CUDA MPS (NVIDIA's Multi-Process Service) for the lab grid's trainings and evaluations (preset key `mps`).

The lab trains several small drafters side by side on one GPU. A step is thousands of small kernels and a few
host synchronisations; without MPS the GPU time-slices between the processes' contexts, and the 320944e lease saw
six 1,800/600-step trainings side by side reach ~11.5 steps/s together, four ~15.5 (one alone: ~10-18). Under
MPS the processes share one context and their kernels run side by side. (The evaluations, batch one and bound by
their host loop, gained nothing from it at 320944e.)
`start` brings up a control daemon with its own pipe and log folders and checks that a client can compute
through it; it returns the environment that makes a process a client, or None (no daemon program, or the check
failed: the processes then run time-sliced, as before, and the log says why). `stop` ends the daemon.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

DAEMON = "nvidia-cuda-mps-control"
PROBE = "import torch; x = torch.ones(1024, device='cuda'); print(int((x * 2).sum()))"


def daemon() -> str | None:
    """The control program: on the PATH, or in the driver's folder (containers mount it at /usr/local/nvidia)."""
    found = shutil.which(DAEMON)
    if found:
        return found
    for d in ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin"):
        if os.access(os.path.join(d, DAEMON), os.X_OK):
            return os.path.join(d, DAEMON)
    return None


def start(workdir: str, log) -> dict[str, str] | None:
    """Start a daemon whose pipes live under workdir; the client environment, or None (logged why)."""
    exe = daemon()
    if exe is None:
        log(f"mps: no {DAEMON} on this machine; the grid runs time-sliced")
        return None
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(workdir, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(workdir, "log")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    full = {**os.environ, **env}
    try:
        rc = subprocess.run([exe, "-d"], env=full, timeout=30, capture_output=True, text=True)
        if rc.returncode != 0:
            log(f"mps: the daemon did not start ({rc.returncode}: {(rc.stderr or rc.stdout).strip()[:200]}); "
                "the grid runs time-sliced")
            return None
        probe = subprocess.run([sys.executable, "-c", PROBE], env=full, timeout=120, capture_output=True, text=True)
        if probe.returncode != 0 or probe.stdout.strip() != "2048":
            tail = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["no output"]
            log(f"mps: a client could not compute through the daemon ({tail[0][:200]}); the grid runs time-sliced")
            stop(env)
            return None
    except subprocess.TimeoutExpired as e:
        log(f"mps: {e}; the grid runs time-sliced")
        stop(env)
        return None
    log(f"mps: daemon up ({env['CUDA_MPS_PIPE_DIRECTORY']}); the grid's trainings and evaluations run as its clients")
    return env


def stop(env: dict[str, str]) -> None:
    """Ask the daemon of this environment to quit (its clients have ended)."""
    exe = daemon()
    if exe:
        try:
            subprocess.run([exe], input="quit\n", env={**os.environ, **env}, timeout=30, capture_output=True,
                           text=True)
        except subprocess.TimeoutExpired:
            pass
