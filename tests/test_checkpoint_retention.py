"""A run's checkpoints: the ``checkpoint.keep`` newest complete ones stay (app/checkpoints.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from staleflow.app.checkpoints import CHECKPOINTS, LOOP_STATE, TRAINER_DIR, latest_checkpoint, save_checkpoint


class _Trainer:
    """Writes a trainer folder of one file, as a trainer's checkpoint would."""

    def save_checkpoint(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trainer_state.pt").write_bytes(b"state")


def test_keep_counts_complete_checkpoints_only(tmp_path: Path) -> None:
    """A run stopped while writing step 5 (no loop state) and resumed from step 4: after step 6,
    two complete checkpoints (4 and 6) stay, not step 5's remains beside step 6 alone."""
    loop = types.SimpleNamespace(state_dict=lambda: {"steps_done": 0})
    for step in (2, 4):
        save_checkpoint(loop, _Trainer(), tmp_path, step, keep=2)
    _Trainer().save_checkpoint(tmp_path / CHECKPOINTS / "step-000005" / TRAINER_DIR)  # the stopped write
    save_checkpoint(loop, _Trainer(), tmp_path, 6, keep=2)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir()) == ["step-000004", "step-000006"]
    assert latest_checkpoint(tmp_path) == tmp_path / CHECKPOINTS / "step-000006"


def test_a_checkpoint_rewritten_is_incomplete_until_its_loop_state_is_written(tmp_path: Path) -> None:
    """A folder written again (a resumed run reaching the step of a stopped write) loses its old
    loop state first: a write stopped in between leaves it incomplete, not old loop state beside new
    trainer files."""
    loop = types.SimpleNamespace(state_dict=lambda: {"steps_done": 2})
    save_checkpoint(loop, _Trainer(), tmp_path, 2, keep=2)

    class Failing(_Trainer):
        def save_checkpoint(self, folder: Path) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(loop, Failing(), tmp_path, 2, keep=2)
    assert not (tmp_path / CHECKPOINTS / "step-000002" / LOOP_STATE).exists()
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(loop, _Trainer(), tmp_path, 2, keep=2)
    assert json.loads((tmp_path / CHECKPOINTS / "step-000002" / LOOP_STATE).read_text()) == {"steps_done": 2}
