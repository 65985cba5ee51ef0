"""Where a training run's notices go: every one into ``<run_dir>/logs/``; on the console the progress
bar, the evaluations, the summary and what may signal a problem (``staleflow train --verbose``: every
notice of the engines and of Ray live, as well).

* Each vLLM engine actor writes ``logs/<instance>.log`` (:mod:`staleflow.adapters.vllm.logs`: the
  actor's whole output, and vLLM's logging configured with vLLM's own setting).
* The driver's Ray notices go to ``logs/driver.log``; Ray's console handler shows its warnings and
  errors (everything with ``verbose``), but for the notice that Ray turned on token authentication
  for the new local cluster, its secure default (:data:`QUIET_RAY_LOGGERS`: in the file only).
"""

from __future__ import annotations

import logging
from pathlib import Path

from staleflow.adapters.vllm.logs import EngineLogs

LOGS_DIR = "logs"
#: Ray loggers of the driver whose notices are expected on every run: in the file only (unless verbose)
QUIET_RAY_LOGGERS = ("ray._private.authentication.authentication_token_setup",)


def engine_logs(run_dir: Path, name: str, verbose: bool) -> EngineLogs:
    """The log file settings of the engine actor ``name`` of the run in ``run_dir``."""
    return EngineLogs(str(Path(run_dir).resolve() / LOGS_DIR / f"{name}.log"), verbose)


class DriverLogs:
    """Ray's notices in this process to ``<run_dir>/logs/driver.log`` until :meth:`close` (see the
    module docstring)."""

    def __init__(self, run_dir: Path, verbose: bool) -> None:
        import ray  # noqa: F401 - sets up the "ray" logger and its console handler

        (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
        self._logger = logging.getLogger("ray")
        self._console = [(handler, handler.level) for handler in self._logger.handlers]
        for handler, _ in self._console:
            handler.setLevel(logging.INFO if verbose else logging.WARNING)
        self._file: logging.FileHandler | None = logging.FileHandler(run_dir / LOGS_DIR / "driver.log", encoding="utf-8")
        self._logger.addHandler(self._file)
        self._quiet = [] if verbose else [logging.getLogger(name) for name in QUIET_RAY_LOGGERS]
        for logger in self._quiet:  # to the file only, not through the "ray" logger's console handler
            logger.addHandler(self._file)
            logger.propagate = False

    def close(self) -> None:
        """Put Ray's console handlers back as they were and close the file (again: nothing)."""
        if self._file is None:
            return
        self._logger.removeHandler(self._file)
        for logger in self._quiet:
            logger.removeHandler(self._file)
            logger.propagate = True
        self._file.close()
        self._file = None
        for handler, level in self._console:
            handler.setLevel(level)
