"""What the GPU did while a suite step ran: nvidia-smi samples in the step's logs.

Two samplers run beside the step: the GPUs once a second (utilisation, memory, SM clock, power,
temperature, throttle reasons) and the compute processes every two seconds (pid, name, memory),
so that a step slower than its twin can be told apart: a lower clock, a throttle, or another
process holding the GPU. Standard library only, like the driver.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

GPU_QUERY = (
    "timestamp,index,utilization.gpu,memory.used,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
    "clocks_event_reasons.active"
)
APPS_QUERY = "timestamp,gpu_uuid,pid,process_name,used_memory"


def sampler_commands(gpu_csv: Path, apps_csv: Path) -> list[tuple[list[str], Path]]:
    """The two nvidia-smi loops and where each writes."""
    return [
        (["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv", "-lms", "1000"], gpu_csv),
        (["nvidia-smi", f"--query-compute-apps={APPS_QUERY}", "--format=csv", "-lms", "2000"], apps_csv),
    ]


@contextlib.contextmanager
def watch(log_dir: Path, name: str, enabled: bool = True) -> Iterator[list[Path]]:
    """Sample the GPUs into ``<log_dir>/<name>.gpu.csv`` and ``<name>.apps.csv`` while the block runs."""
    if not enabled or shutil.which("nvidia-smi") is None:
        yield []
        return
    procs: list[subprocess.Popen[bytes]] = []
    paths: list[Path] = []
    for argv, path in sampler_commands(log_dir / f"{name}.gpu.csv", log_dir / f"{name}.apps.csv"):
        with contextlib.suppress(OSError), path.open("wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
            paths.append(path)
    try:
        yield paths
    finally:
        for proc in procs:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()
