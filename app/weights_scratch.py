"""Where a run's rollout engines write the weight files they reload (reference-mode pulls, the
version-0 load): shared memory when the machine has room for them, else the run directory.

A reference pull writes the state dict to a safetensors file that vLLM then reads back; on disk that
is a write and a read of the full model per instance and version. ``/dev/shm`` (tmpfs) keeps both in
memory. Each engine deletes its file once loaded, so the room needed is one copy per instance
(with a margin of two, for a load overlapping the next); a machine without that much free shared
memory gets the run directory, and the run says so.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")
#: the run-directory fallback, removed when the run ends (``training_job.SCRATCH``)
DISK_SCRATCH = ".weights"


def model_bytes(model_dir: Path) -> int:
    """Bytes of the safetensors weights in ``model_dir`` (every shard)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def weights_scratch_dir(run_dir: Path, copy_bytes: int, copies: int, shared_memory: Path = SHARED_MEMORY,
                        log: Callable[[str], None] = print) -> Path:
    """The folder for the run's weight files: ``shared_memory/staleflow-<run>`` when it has room for
    ``2 * copies`` files of ``copy_bytes``, else ``run_dir/.weights`` (logged, with why)."""
    needed = 2 * copies * copy_bytes
    if shared_memory.is_dir():
        free = shutil.disk_usage(shared_memory).free
        if free >= needed:
            run = run_dir.resolve()
            return shared_memory / f"staleflow-{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:8]}"
        reason = f"{shared_memory} has {free / 2**20:.0f} MiB free, the run needs {needed / 2**20:.0f} MiB"
    else:
        reason = f"this machine has no {shared_memory}"
    fallback = run_dir / DISK_SCRATCH
    log(f"weight files go to disk ({fallback}): {reason}")
    return fallback
