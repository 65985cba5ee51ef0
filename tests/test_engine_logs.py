"""A run's notices go to its log files and the console keeps only what may signal a problem: an
engine actor's output goes to its log file, the console (the stderr Ray forwards) getting warnings
of vLLM and errors only of the loggers of expected notices, or every vLLM notice with ``verbose``;
the driver's Ray notices go to ``driver.log``. Each case runs in a process of its own, as an engine
actor does (the routing moves the process's file descriptors 1 and 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from skips import needs

SCRIPT = """
import logging, os, sys
from staleflow.adapters.vllm.logs import EngineLogs, route_engine_output
route_engine_output(EngineLogs(sys.argv[1], verbose=sys.argv[2] == "verbose"))
if sys.argv[3] == "vllm":  # vLLM configures its logging when imported: from VLLM_LOGGING_CONFIG_PATH
    from vllm.logger import init_logger as get_logger
else:
    get_logger = logging.getLogger
print("Loading safetensors checkpoint shards: 100%")
os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\\n")
get_logger("vllm.model_executor.model_loader.reload.layerwise").warning("RotaryEmbedding: Failed to load weights")
get_logger("vllm.v1.worker.cpu_worker").warning("libtcmalloc is not found in LD_PRELOAD")
get_logger("vllm.v1.engine.core").info("init engine took 2.40 s")
get_logger("vllm.v1.engine.core").warning("the KV cache cannot hold one request: a real problem")
get_logger("vllm.model_executor.model_loader.reload.layerwise").error("a reload failed")
get_logger("some.library").warning("a library's deprecation notice")
"""
NOTICES = [
    "Loading safetensors checkpoint shards: 100%",
    "Warning: NUMA binding",
    "RotaryEmbedding: Failed to load weights",
    "libtcmalloc is not found in LD_PRELOAD",
    "init engine took 2.40 s",
    "the KV cache cannot hold one request: a real problem",
    "a reload failed",
    "a library's deprecation notice",
]


def _run(tmp_path: Path, verbose: bool, logger: str = "logging") -> tuple[list[str], str, str]:
    """The console's lines (stderr), stdout, and the log file of one process."""
    log = tmp_path / "logs" / "rollout-0.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), "verbose" if verbose else "quiet", logger],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return done.stderr.splitlines(), done.stdout, log.read_text()


def _shown(console: list[str]) -> list[str]:
    return [notice for notice in NOTICES if any(notice in line for line in console)]


def test_the_console_shows_only_what_may_signal_a_problem_and_the_file_keeps_everything(tmp_path: Path) -> None:
    console, stdout, log = _run(tmp_path, verbose=False)
    assert _shown(console) == ["the KV cache cannot hold one request: a real problem", "a reload failed"]
    assert len(console) == 2 and stdout == ""
    assert all(notice in log for notice in NOTICES), log
    assert (tmp_path / "logs" / "rollout-0.logging.json").is_file()


def test_verbose_shows_every_vllm_notice_live(tmp_path: Path) -> None:
    console, _, log = _run(tmp_path, verbose=True)
    # the process's raw output (progress bars, C++ warnings) and other libraries' warnings stay in the file
    assert _shown(console) == NOTICES[2:7]
    assert all(notice in log for notice in NOTICES)


@pytest.mark.vllm
@pytest.mark.slow
@needs("vllm", "cpu-infer")
def test_vllm_takes_the_configuration_when_it_is_imported(tmp_path: Path) -> None:
    console, stdout, log = _run(tmp_path, verbose=False, logger="vllm")
    assert _shown(console) == ["the KV cache cannot hold one request: a real problem", "a reload failed"]
    assert stdout == "" and all(notice in log for notice in NOTICES)


DRIVER_SCRIPT = """
import logging, sys
from pathlib import Path
from staleflow.app.run_logs import DriverLogs
logs = DriverLogs(Path(sys.argv[1]), verbose=False)
logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
logging.getLogger("ray._private.authentication.authentication_token_setup").warning("Token authentication is enabled")
logging.getLogger("ray._private.worker").warning("a worker died: a real problem")
logs.close()
logging.getLogger("ray._private.worker").info("after the run")  # Ray's console handler is as it was
"""


def test_the_drivers_ray_notices_go_to_the_run_folder_and_only_warnings_to_the_console(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", DRIVER_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, check=True)
    console = done.stderr
    assert "a real problem" in console and "after the run" in console
    assert "Started a local" not in console and "Token authentication" not in console
    log = (tmp_path / "logs" / "driver.log").read_text()
    assert all(notice in log for notice in ("Started a local", "Token authentication", "a real problem")) and "after the run" not in log


def test_logged_builds_the_engine_after_routing_its_actors_output(tmp_path: Path) -> None:
    from staleflow.adapters.vllm.logs import logged

    assert logged(dict, None) is dict  # no logs: the factory itself, the output left as it is
    script = (
        "import sys; from staleflow.adapters.vllm.logs import EngineLogs, logged; "
        "built = logged(dict, EngineLogs(sys.argv[1]))(instance='rollout-0'); print('built', built)"
    )
    log = tmp_path / "rollout-0.log"
    done = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=300, check=True)
    assert (done.stdout, done.stderr) == ("", "")
    assert log.read_text() == "built {'instance': 'rollout-0'}\n"
