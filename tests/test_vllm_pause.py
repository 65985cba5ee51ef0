"""A weight update pauses the engine core's scheduling when the core runs in another process
(tensor parallelism): every call of the update, and the version label, fall inside the pause, so no
step runs a half-loaded model or samples new weights under the old label. In-process there is no
pause (the engine's own thread steps the core)."""

from __future__ import annotations

from typing import Any

import pytest
from staleflow.adapters.vllm.weight_transfer import InstanceWeightSync


class _InProcessCore:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls


class _SubprocessCore(_InProcessCore):
    """The multiprocessing client: utility calls go to the engine core's process."""

    def call_utility(self, method: str, *args: Any) -> None:
        self.calls.append(f"{method}{args}")


class _Engine:
    def __init__(self, core_type: type) -> None:
        self.calls: list[str] = []
        self.engine_core = core_type(self.calls)

    def collective_rpc(self, method: str, **kwargs: Any) -> list[None]:
        self.calls.append(method)
        return [None, None]

    def set_weight_version(self, version: str) -> None:
        self.calls.append(f"set_weight_version {version}")


class _Weights:
    """Stands in for ``TransferWeights``: the calls vLLM's trainer-side engines make for one version."""

    channel = "instance"

    def connect(self, instance_id: str, receivers: int, client: Any, backend: str, held: object = None) -> object:
        client.init_weight_transfer_engine({"receivers": receivers})
        return instance_id

    def prepare(self) -> dict[str, Any]:
        return {"deadline_s": 1.0}

    def deliver(self, instance_id: str, client: Any, update: Any = None, group: object = None) -> int:
        client.start_weight_update()
        client.update_weights({})
        client.finish_weight_update(weight_version="3")
        return 10


def _receive(core_type: type) -> list[str]:
    engine = _Engine(core_type)
    sync = InstanceWeightSync(engine, "rollout-0", {"tensor_parallel_size": 2}, "gloo", version=2)
    engine.calls.clear()
    assert sync.receive(_Weights()) == 10
    return engine.calls


def test_an_update_into_a_subprocess_engine_core_runs_with_its_scheduling_paused() -> None:
    assert _receive(_SubprocessCore) == [
        "init_weight_transfer_engine",
        "pause_scheduler('keep', False)",  # keep: running requests keep their KV cache and go on after it
        "start_weight_update", "update_weights", "finish_weight_update", "set_weight_version 3",
        "resume_scheduler()",
    ]


def test_an_update_into_an_in_process_engine_core_needs_no_pause() -> None:
    assert _receive(_InProcessCore) == [
        "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update", "set_weight_version 3",
    ]


def test_a_failed_update_resumes_scheduling() -> None:
    class Failing(_Weights):
        def deliver(self, instance_id: str, client: Any, update: Any = None, group: object = None) -> int:
            client.start_weight_update()
            raise ConnectionError("sender gone")

    engine = _Engine(_SubprocessCore)
    sync = InstanceWeightSync(engine, "rollout-0", {}, "gloo", version=0)
    with pytest.raises(ConnectionError):
        sync.receive(Failing())
    assert engine.calls[-2:] == ["start_weight_update", "resume_scheduler()"]


def test_the_chunked_nccl_engine_is_what_vllms_factory_builds_for_its_name_and_refuses_before_init() -> None:
    """``staleflow_nccl`` registered with vLLM's factory loads the chunked engine (a subclass of vLLM's
    NCCL engine, imported lazily by its module path); receiving before the group exists is refused by
    name. (The receive itself broadcasts on a CUDA stream: the GPU check runs it.)"""
    from skips import require

    require("vllm", "cpu-infer")
    from staleflow.adapters.vllm.weight_transfer import ENGINES, register_engines
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    register_engines()
    register_engines()  # a second registration in the same process is a no-op
    name = ENGINES["nccl"][0]
    engine_class = WeightTransferEngineFactory._registry[name]()
    assert engine_class.__name__ == "ChunkedNCCLWeightTransferEngine" and issubclass(engine_class, NCCLWeightTransferEngine)
    engine = engine_class.__new__(engine_class)
    engine.model_update_group, engine.groups = None, {}
    with pytest.raises(RuntimeError, match="the NCCL weight transfer has no instance group: call init_weight_transfer_engine first"):
        engine.receive_weights(engine_class.update_info_cls(names=[], dtype_names=[], shapes=[]))


def test_the_chunked_nccl_engine_gives_up_a_broadcast_at_its_deadline_and_aborts_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45: the receiving worker's NCCL wait had no deadline (a broadcast, then a device
    synchronize). Now each broadcast's completion is polled until the update's ``timeout_s``; past
    it the communicator is aborted and dropped and the update fails. (CUDA stood in for: an event
    that never completes.)"""
    import time

    import torch
    from skips import require

    require("vllm", "cpu-infer")
    from staleflow.adapters.vllm.nccl_chunks import ChunkedNCCLUpdateInfo, ChunkedNCCLWeightTransferEngine

    class NeverDone:
        def record(self) -> None:
            pass

        def query(self) -> bool:
            return False

    class Group:
        destroyed = False

        def broadcast(self, buffer: torch.Tensor, src: int, stream: Any) -> None:
            pass

        def destroy(self) -> None:
            self.destroyed = True

    class Model:
        def load_weights(self, weights: Any) -> None:
            for _ in weights:
                pass

    monkeypatch.setattr(torch.cuda, "Event", NeverDone)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    engine = ChunkedNCCLWeightTransferEngine.__new__(ChunkedNCCLWeightTransferEngine)
    group = Group()
    engine.model_update_group, engine.packed_buffer_size_bytes, engine.device, engine.model = group, 1 << 10, "cpu", Model()
    engine.groups = {"instance": group}
    info = ChunkedNCCLUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[64]], timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="NCCL broadcast did not complete before its deadline"):
        engine.receive_weights(info)
    assert time.monotonic() - started >= 0.2  # it waited until the deadline, then gave up
    assert group.destroyed and engine.model_update_group is None and engine.groups == {}


def test_the_chunked_nccl_engine_keeps_a_communicator_per_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective's ``init_weight_transfer_engine`` (``channel="collective"``) makes a second
    communicator beside the instance's own; a new one for a channel replaces (destroys) only that
    channel's; an update is refused on a channel the worker has not joined. (vLLM's group set-up
    stood in for: it needs CUDA.)"""
    from skips import require

    require("vllm", "cpu-infer")
    from staleflow.adapters.vllm.nccl_chunks import ChunkedNCCLInitInfo, ChunkedNCCLUpdateInfo, ChunkedNCCLWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    class Group:
        def __init__(self) -> None:
            self.destroyed = False

        def destroy(self) -> None:
            self.destroyed = True

    def made(self: Any, init_info: Any) -> None:
        self.model_update_group = Group()

    monkeypatch.setattr(NCCLWeightTransferEngine, "init_transfer_engine", made)
    engine = ChunkedNCCLWeightTransferEngine.__new__(ChunkedNCCLWeightTransferEngine)
    engine.groups, engine.model_update_group = {}, None

    def info(channel: str) -> ChunkedNCCLInitInfo:
        return ChunkedNCCLInitInfo(master_address="10.0.0.1", master_port=1, rank_offset=1, world_size=3, channel=channel)

    engine.init_transfer_engine(info("instance"))
    own = engine.groups["instance"]
    engine.init_transfer_engine(info("collective"))
    first = engine.groups["collective"]
    engine.init_transfer_engine(info("collective"))
    assert engine.groups["instance"] is own and not own.destroyed and first.destroyed and engine.groups["collective"] is not first
    with pytest.raises(RuntimeError, match="no elsewhere group"):
        engine.receive_weights(ChunkedNCCLUpdateInfo(names=[], dtype_names=[], shapes=[], channel="elsewhere"))
    engine.shutdown()
    assert own.destroyed and engine.groups == {}


@pytest.mark.parametrize(("core_type", "overlap"), [(_InProcessCore, False), (_SubprocessCore, True)])
def test_engines_whose_workers_share_this_process_take_turns_at_an_updates_finish(core_type: type, overlap: bool) -> None:
    """vLLM's current config is process-wide and a worker sets it around an update's start and
    finish: engines whose workers run in this process (in-process engine cores) take turns at them,
    so one engine's finish never runs under another's config. Workers in other processes (an engine
    core in a subprocess) do not wait for each other."""
    import threading
    import time

    from staleflow.adapters.vllm.weight_transfer import EngineWeightSyncClient

    inside: list[int] = []
    most: list[int] = [0]

    class Slow(_Engine):
        def collective_rpc(self, method: str, **kwargs: Any) -> list[None]:
            inside.append(1)
            most[0] = max(most[0], len(inside))
            time.sleep(0.2)
            inside.pop()
            return [None]

    clients = [EngineWeightSyncClient(Slow(core_type)) for _ in range(2)]
    threads = [threading.Thread(target=client.finish_weight_update) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert (most[0] == 2) is overlap
