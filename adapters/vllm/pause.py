"""Weight updates with the engine core's scheduling paused, when the core runs in another process.

With tensor parallelism (vLLM's multiprocessing executor) the engine core runs in a process of its own
and steps by itself between the calls it receives. A weight update is several calls: the transfer's
``start_weight_update`` puts every layer on the meta device (vLLM's layerwise reload), ``update_weights``
fills them, ``finish_weight_update`` processes them, then ``set_weight_version`` labels the steps
that follow. A step scheduled between two of these calls would run a half-loaded model, or sample
with the new weights under the old label. vLLM's own rule (``v1/engine/core.py``: "weight versions
change only while generation is paused") is kept by pausing the scheduler in ``keep`` mode (running
requests keep their KV cache and go on after the update) and resuming it once the version is set.

With the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the engine's own thread
steps it and runs the update between two steps: there is nothing to pause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from staleflow.adapters.rlkit import bounded_calls
from staleflow.runtime.interfaces import TransferFailedError


@contextmanager
def scheduling_paused(llm_engine: Any) -> Iterator[bool]:
    """Pause ``llm_engine``'s scheduler (keeping running requests) for the body when its engine core
    runs in another process; yields whether it paused. Each of the two utility calls ends within
    :data:`~staleflow.adapters.rlkit.bounded_calls.CONTROL_CALL_S` or raises ``TransferFailedError``
    (an instance failure)."""
    core = llm_engine.engine_core
    if not hasattr(core, "call_utility"):  # in-process client: no step runs while this thread updates
        yield False
        return
    # keep: requests and their KV cache stay; each utility call bounded (vLLM's waits with no timeout)
    bound = bounded_calls.CONTROL_CALL_S
    bounded_calls.bounded(lambda: core.call_utility("pause_scheduler", "keep", False), "pausing the scheduler", bound)
    try:
        yield True
    except BaseException:
        # the body's error stands (an update left open: the instance is lost), not a resume stuck behind the same worker
        with contextlib.suppress(TransferFailedError):
            bounded_calls.bounded(lambda: core.call_utility("resume_scheduler"), "resuming the scheduler", bound)
        raise
    bounded_calls.bounded(lambda: core.call_utility("resume_scheduler"), "resuming the scheduler", bound)


def reload_weights_file(llm_engine: Any, path: Path, version: int) -> None:
    """Reload every worker's weights from the safetensors file ``path`` (the worker extension's
    ``staleflow_reload_safetensors``) and label the steps that follow ``version``, as one pause."""
    with scheduling_paused(llm_engine):
        llm_engine.collective_rpc("staleflow_reload_safetensors", args=(str(path),))
        llm_engine.set_weight_version(str(version))
