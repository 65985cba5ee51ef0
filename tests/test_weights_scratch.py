"""Where a run's engines write the weight files they reload: shared memory when it has room, else the
run directory (said in the log); and the Ray cluster of a run forwards its actors' logs."""

from __future__ import annotations

from pathlib import Path

import pytest
from staleflow.app.weights_scratch import model_bytes, weights_scratch_dir


def test_weight_files_go_to_shared_memory_when_it_has_room(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    lines: list[str] = []
    chosen = weights_scratch_dir(tmp_path / "run", copy_bytes=1 << 20, copies=2, shared_memory=shm, log=lines.append)
    assert chosen.parent == shm and chosen.name.startswith("staleflow-run-") and lines == []
    assert weights_scratch_dir(tmp_path / "run", 1 << 20, 2, shared_memory=shm) == chosen  # one folder per run
    assert weights_scratch_dir(tmp_path / "other" / "run", 1 << 20, 2, shared_memory=shm) != chosen


def test_weight_files_fall_back_to_the_run_directory_and_say_why(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    lines: list[str] = []
    too_big = 1 << 60
    assert weights_scratch_dir(tmp_path / "run", too_big, 3, shared_memory=shm, log=lines.append) == tmp_path / "run" / ".weights"
    assert len(lines) == 1 and "weight files go to disk" in lines[0] and "MiB free, the run needs" in lines[0]
    lines.clear()
    assert weights_scratch_dir(tmp_path / "run", 1, 1, shared_memory=tmp_path / "absent", log=lines.append) == tmp_path / "run" / ".weights"
    assert "has no" in lines[0]


def test_model_bytes_counts_every_shard(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "config.json").write_text("{}")
    assert model_bytes(tmp_path) == 15


class _Started(Exception):
    pass


def test_a_runs_engines_write_their_weight_files_to_shared_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job hands its engines the scratch folder chosen above (before: always ``run_dir/.weights``,
    on disk)."""
    import staleflow.app.training_job as training_job
    from staleflow.runtime.settings.config import load_config

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr("staleflow.app.weights_scratch.SHARED_MEMORY", shm)
    monkeypatch.setattr(training_job, "weights_scratch_dir",
                        lambda run_dir, copy_bytes, copies: weights_scratch_dir(run_dir, copy_bytes, copies, shared_memory=shm))
    seen: dict = {}

    class Placement:
        def place_reserved(self, name, factory, *args, **kwargs):
            seen.update(kwargs)
            raise _Started

    monkeypatch.setattr(training_job.TrainingJob, "_reserve", lambda job: setattr(job, "_placement", Placement()))
    job = training_job.TrainingJob(load_config(overrides=["warmup.when=never"]), tmp_path / "run")
    with pytest.raises(_Started):
        job.build()
    assert Path(seen["weights_dir"]).parent == shm


def test_a_runs_ray_cluster_forwards_its_actors_logs_to_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's and NCCL's errors are printed in the engine actors: with ``log_to_driver=False`` a failed
    start showed only Ray's own error, not the cause."""
    import staleflow.app.training_job as training_job
    from staleflow.runtime.settings.config import load_config

    seen: dict = {}

    def placement(**kwargs):
        seen.update(kwargs)
        raise _Started

    monkeypatch.setattr(training_job, "RayPlacement", placement)
    with pytest.raises(_Started):
        training_job.TrainingJob(load_config(), tmp_path / "run")._reserve()
    assert seen["log_to_driver"] is True
