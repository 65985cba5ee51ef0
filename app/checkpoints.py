"""A training run's checkpoints: ``checkpoints/step-<n>/`` with the trainer's files and the run
loop's state (written last, so a folder with it is complete).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"


LOOP_STATE = "loop_state.json"


TRAINER_DIR = "trainer"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of a run (one with its loop state written last)."""
    folders = sorted((run_dir / CHECKPOINTS).glob("step-*"))
    complete = [f for f in folders if (f / LOOP_STATE).is_file()]
    return complete[-1] if complete else None


# ------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(loop: Any, trainer: Any, run_dir: Path, step: int, keep: int) -> Path:
    """Trainer (model, optimiser), then the loop (protocol, servers, partials); loop state last. Then
    the ``keep`` newest complete checkpoints stay and every other folder goes (an incomplete one,
    left by a run that stopped while writing it, counts for nothing)."""
    folder = run_dir / CHECKPOINTS / f"step-{step:06d}"
    state = loop.state_dict()  # interrupts running requests: their partials go to the TS
    (folder / LOOP_STATE).unlink(missing_ok=True)  # a folder being rewritten is incomplete until its end
    trainer.save_checkpoint(folder / TRAINER_DIR)
    (folder / LOOP_STATE).write_text(json.dumps(state), encoding="utf-8")
    folders = sorted((run_dir / CHECKPOINTS).glob("step-*"))
    kept = [f for f in folders if (f / LOOP_STATE).is_file()][-keep:]
    for old in folders:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def restore_trainer(trainer: Any, checkpoint: Path, state: dict[str, Any]) -> None:
    version = trainer.load_checkpoint(checkpoint / TRAINER_DIR)
    if state["parameter_server"]["latest_version"] != version:
        raise ValueError(
            f"checkpoint {checkpoint}: trainer is at version {version} but the loop state at {state['parameter_server']['latest_version']}"
        )
