"""Where a rollout engine actor's output goes: all of it to a log file in the run folder, and to the
console only what may signal a problem.

A vLLM engine prints a great deal that is expected on every run: its start-up notes (INFO), notes
on settings StaleFlow chose on purpose (eager mode, a seed per engine, no Triton on CPU), advice to
preload tcmalloc and Intel OpenMP, torch's and Python's deprecation notices, loading progress bars,
and at every weight reload ``RotaryEmbedding: Failed to load weights``. That last one is a harmless
skip: a rotary embedding's only tensor is its cos/sin cache, a non-persistent buffer computed from
the model config, which no checkpoint holds. vLLM's layerwise reload
(``vllm/model_executor/model_loader/reload/layerwise.py``) counts it as loadable, finds none of it
loaded, warns, and puts the original buffer back unchanged (``_place_kernel_tensors``); the
reloaded engine's log-probs equal the trainer's on the new version (``tests/test_vllm_engine.py``).

:func:`route_engine_output`, in an engine actor's own process before vLLM is imported (:func:`logged`
builds an engine after it), points the
process's stdout and stderr (file descriptors 1 and 2: Python, C++ and progress bars alike) at the
log file, and gives vLLM a logging configuration (``VLLM_LOGGING_CONFIG_PATH``, vLLM's own setting)
whose console handler writes to the original stderr, which Ray forwards to the driver: warnings of
vLLM and StaleFlow, errors of any logger, and errors only of the :data:`QUIET_LOGGERS`. With
``verbose`` the console gets everything vLLM logs (INFO and up), as without StaleFlow.
"""

from __future__ import annotations

import functools
import json
import logging
import logging.config
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

#: vLLM loggers whose warnings are expected on every StaleFlow run (why): in the log file; on the console only their errors
QUIET_LOGGERS = {
    "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights at a reload (module docstring)",
    "vllm.v1.worker.cpu_worker": "tcmalloc and Intel OpenMP not in LD_PRELOAD: a speed tip for vLLM-CPU",
    "vllm.platforms.cpu": "Triton not installed (StaleFlow removes it: no CPU backend); SSM cache type notes",
    "vllm.config.vllm": "eager mode set (StaleFlow's choice on CPU) disables torch.compile and Model Runner V2",
    "vllm.engine.arg_utils": "a global random seed in an in-process engine (each engine has its actor's process)",
}
#: where the console handler writes: the process's stderr as it was before :func:`route_engine_output`
CONSOLE: TextIO = sys.stderr
FORMAT = "%(levelname)s %(asctime)s %(process)d %(name)s: %(message)s"
_T = TypeVar("_T")


@dataclass(frozen=True)
class EngineLogs:
    """An engine actor's log file (``file``) and whether its notices also show live (``verbose``)."""

    file: str
    verbose: bool = False


def logging_config(verbose: bool) -> dict[str, Any]:
    """The ``logging.config.dictConfig`` of an engine actor (see the module docstring): the log file
    is the process's stderr once :func:`route_engine_output` has moved it."""
    console = "console" if verbose else "console_errors"
    stream = f"ext://{__name__}.CONSOLE"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "handlers": {
            "file": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain", "level": "DEBUG"},
            "console": {"class": "logging.StreamHandler", "stream": stream, "formatter": "plain", "level": "INFO" if verbose else "WARN"},
            "console_errors": {"class": "logging.StreamHandler", "stream": stream, "formatter": "plain", "level": "ERROR"},
        },
        "loggers": {
            "vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False},
            "staleflow": {"handlers": ["file", "console"], "level": "INFO", "propagate": False},
            **{name: {"handlers": ["file", console], "level": "INFO", "propagate": False} for name in QUIET_LOGGERS},
        },
        "root": {"handlers": ["file", "console_errors"], "level": "WARNING"},
    }


def route_engine_output(logs: EngineLogs) -> Path:
    """Send this process's output to ``logs.file`` and set up its logging (module docstring); call it
    in the engine actor before vLLM is imported. Returns the logging configuration file it wrote."""
    global CONSOLE
    path = Path(logs.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    CONSOLE = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8")
    with open(path, "a", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    config = logging_config(logs.verbose)
    config_file = path.with_suffix(".logging.json")
    config_file.write_text(json.dumps(config, indent=1), encoding="utf-8")
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_file)  # read when vLLM is imported and again when an engine starts
    logging.config.dictConfig(config)
    return config_file


def logged(factory: Callable[..., _T], logs: EngineLogs | None) -> Callable[..., _T]:
    """``factory`` (an engine class) to build in an actor of its own after routing the actor's output
    as ``logs`` says (``None``: ``factory`` itself, the output left as it is)."""
    return factory if logs is None else functools.partial(_build_logged, logs, factory)


def _build_logged(logs: EngineLogs, factory: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    route_engine_output(logs)  # before the engine imports vLLM: its import-time notices too
    return factory(*args, **kwargs)
