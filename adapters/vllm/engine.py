"""The :class:`~staleflow.runtime.interfaces.RolloutEngine` seam on a real vLLM engine.

One background thread owns a vLLM ``LLMEngine`` and steps it; the runtime's calls (submit, interrupt,
abort, load_weights) are queued to that thread and run *between* two engine steps, so every call sees
a consistent engine and needs no lock inside vLLM. This gives the three things StaleFlow needs:

* **per-token versions**: each token gets the weight version vLLM recorded for the step that sampled
  it (each reload ends with ``set_weight_version``), not the version current when it is absorbed;
* **in-place reload keeping running requests**: the same as vLLM's ``pause_generation(mode="keep")``
  -> reload -> resume (paused only when the engine core runs in another process, :mod:`.pause`):
  requests keep their KV cache and go on with the new weights;
* **resumable partials**: an interrupted request comes back with its tokens, behaviour log-probs and
  versions; any engine resumes it with ``prompt + output so far`` as its prompt.

Why ``LLMEngine`` in a thread rather than ``AsyncLLM``: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
``LLMEngine`` runs in this process (start-up 2-3 s on CPU), while ``AsyncLLM`` always starts its
engine core in a subprocess (13-19 s on CPU).

vLLM reads its environment at import time; :func:`set_vllm_env_defaults` sets the CPU settings the
project measured (``environment.md``) unless they are set already, before vLLM is imported.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self, TypeVar

from staleflow.adapters.rlkit.weight_checksum import WeightChecksumMismatch
from staleflow.adapters.rlkit.weight_sender import TransferWeights, UpdateLeftOpenError
from staleflow.adapters.vllm.llm import check_request, default_weights_dir, kv_tokens, make_llm_engine, weights_file
from staleflow.adapters.vllm.pause import reload_weights_file
from staleflow.adapters.vllm.request_ids import RequestIds
from staleflow.adapters.vllm.settings import SamplingConfig, set_vllm_env_defaults
from staleflow.adapters.vllm.step_meter import StepMeter
from staleflow.adapters.vllm.weight_checksum import engine_checksums, verify_loaded
from staleflow.adapters.vllm.weight_transfer import InstanceWeightSync, token_versions, with_weight_transfer
from staleflow.runtime.coordination.cost_fit import DecodeStepLog
from staleflow.runtime.coordination.cost_model import ProfileRecord
from staleflow.runtime.interfaces import Clock, InstanceLostError, resolve_weights
from staleflow.runtime.run.clock import RealClock
from staleflow.runtime.types import TEMPERATURE_KEY, InstanceSnapshot, RolloutRequest, Trajectory

__all__ = ["EngineFailed", "SamplingConfig", "VLLMEngine", "set_vllm_env_defaults"]

WORKER_EXTENSION = "staleflow.adapters.vllm.worker_extension.WeightReloadExtension"
_T = TypeVar("_T")

@dataclass
class _Published:
    """What the engine thread publishes for :meth:`VLLMEngine.snapshot` (read under the lock)."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_tokens: int = 0
    generated_tokens: int = 0
    loads_pending: int = 0


@dataclass
class _Window:
    """The previous snapshot's token count and time, for ``tokens_per_s`` over the last interval."""

    tokens: int = 0
    wall: float = field(default_factory=time.monotonic)


class EngineFailed(InstanceLostError):
    """The engine thread died or the engine is closed: the instance is lost (the failure contract
    of :mod:`staleflow.runtime.interfaces`), and the run loop recovers its requests."""


class VLLMEngine:
    """A rollout instance on vLLM (see the module docstring). All methods are thread-safe.

    ``model`` is a local model folder. ``version`` is the version of the weights in that folder.
    ``engine_kwargs`` go to vLLM's ``EngineArgs`` (they override the defaults set here).
    """

    def __init__(
        self,
        instance_id: str,
        model: str | os.PathLike[str],
        *,
        version: int = 0,
        sampling: SamplingConfig = SamplingConfig(),
        max_model_len: int = 512,
        max_num_seqs: int = 256,
        seed: int = 0,
        clock: Clock | None = None,
        weights_dir: str | os.PathLike[str] | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        start_timeout_s: float = 900.0,
        verify_weights: bool = False,
    ) -> None:
        model_path = Path(model)
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {model_path} has no config.json (vLLM would try the hub)")
        self.instance_id = instance_id
        self.bytes_received = 0  # weight bytes received through the weight-transfer API
        self.weight_sync: InstanceWeightSync | None = None  # vLLM's weight-sync calls (engine thread), from start-up
        self._verify_weights = verify_weights
        self._version = version
        self._sampling = sampling
        self._max_model_len = max_model_len
        self._clock: Clock = clock if clock is not None else RealClock()
        self._weights_dir = Path(weights_dir) if weights_dir is not None else default_weights_dir()
        self._engine_args: dict[str, Any] = {
            "model": str(model_path),
            "dtype": "float32",
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": True,
            "seed": seed,
            "worker_extension_cls": WORKER_EXTENSION,
            # A reload must not let new requests reuse prompt KV computed with older weights.
            "enable_prefix_caching": False,
            # Behaviour log-probs of the distribution actually sampled from (after temperature).
            "logprobs_mode": "processed_logprobs",
            # Outputs of step t must come back before step t+1 runs (versions are tagged per step).
            "async_scheduling": False,
            "disable_log_stats": True,
        }
        self._engine_args.update(engine_kwargs or {})

        self._commands: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._lock = threading.Lock()
        self._published = _Published()
        self._window = _Window()
        self._live: dict[str, RolloutRequest] = {}  # engine thread only
        self._ids = RequestIds()  # vLLM's internal ids and ours; engine thread only
        self._finished: list[Trajectory] = []  # under the lock
        self._meter = StepMeter(DecodeStepLog())
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        self._llm: Any = None
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"vllm-engine-{instance_id}", daemon=True
        )
        self._thread.start()
        try:
            started.result(timeout=start_timeout_s)
        except TimeoutError:  # (concurrent.futures.TimeoutError is this one)
            self._stopping.set()
            raise TimeoutError(
                f"vLLM engine {instance_id} (model {model_path}) did not start within {start_timeout_s:g} s "
                "(rollout.start_timeout_s; a slow or loaded machine may need more)"
            ) from None

    # ---------------------------------------------------------------- RolloutEngine

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        for request in requests:
            check_request(request, self.instance_id, self._max_model_len)
        self._call(lambda: self._do_submit(list(requests)))

    def interrupt(self, request_ids: Sequence[str]) -> list[RolloutRequest]:
        return self._call(lambda: self._do_stop(list(request_ids)))

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        self._call(lambda: self._do_stop(list(ids)))
        with self._lock:
            self._finished = [t for t in self._finished if t.request_id not in ids]

    def load_weights(self, version: int, weights: Any, broadcast: bool = False) -> None:
        """Reload the weights in place and become ``version``; returns when the new weights serve.

        ``weights``: a safetensors file, a folder holding ``model.safetensors``, a state dict (name ->
        tensor, checkpoint names), which is written to a temporary safetensors file first, a
        :class:`~staleflow.runtime.interfaces.WeightsReference`, fetched here first (from a parameter server in another
        process), or a ``TransferWeights``, through vLLM's weight-transfer API; a global broadcast's load (``broadcast``) too.
        """
        with self._lock:
            self._published.loads_pending += 1
        try:
            if isinstance(weights, TransferWeights):  # staged by its sender while this instance generates
                update = weights.prepare()
                self._call(lambda: self._do_load(version, weights, update))
                return
            weights = resolve_weights(weights)
            path, temporary = weights_file(weights, self._weights_dir, self.instance_id)
            try:
                self._call(lambda: self._do_load(version, path))
            finally:
                if temporary:
                    path.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._published.loads_pending -= 1

    def snapshot(self) -> InstanceSnapshot:
        self._raise_if_failed()
        now_wall = time.monotonic()
        with self._lock:
            published = replace(self._published)
            elapsed = now_wall - self._window.wall
            new_tokens = published.generated_tokens - self._window.tokens
            self._window = _Window(tokens=published.generated_tokens, wall=now_wall)
        return InstanceSnapshot(
            instance_id=self.instance_id,
            version=self._version,
            running=published.running,
            waiting=published.waiting,
            kv_tokens=published.kv_tokens,
            kv_capacity=self.kv_capacity,
            tokens_per_s=new_tokens / elapsed if elapsed > 0 else 0.0,
            time=self._clock.now(),
            loading=published.loads_pending > 0,
        )

    def collect(self) -> list[Trajectory]:
        self._raise_if_failed()
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def next_event_time(self) -> float | None:
        return None

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put((lambda: None, Future()))  # wake the thread
        self._thread.join()

    # ---------------------------------------------------------------- extras

    @property
    def version(self) -> int:
        return self._version

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV cache can hold (all blocks)."""
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def idle(self) -> bool:
        """True when no request is running or waiting."""
        return self._call(lambda: not self._live)

    def decode_steps(self) -> list[ProfileRecord]:
        """The pure decode steps (no prefill in them) measured since the last call: running
        requests, KV-cache tokens and seconds of each, for fitting the cost model."""
        return self._meter.log.drain()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- caller side

    def _call(self, command: Callable[[], _T], timeout: float | None = 600.0) -> _T:
        self._raise_if_failed()
        if threading.current_thread() is self._thread:
            return command()
        done: Future[_T] = Future()
        self._commands.put((command, done))
        return done.result(timeout=timeout)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineFailed(f"{self.instance_id}: the vLLM engine thread failed") from self._failure
        if self._stopping.is_set():
            raise EngineFailed(f"{self.instance_id}: the engine is closed")

    # ---------------------------------------------------------------- engine thread

    def _run(self, started: Future[None]) -> None:
        try:
            args, backend = with_weight_transfer(self._engine_args)
            self._llm = make_llm_engine(args)
            self.weight_sync = InstanceWeightSync(self._llm, self.instance_id, args, backend, self._version)
        except BaseException as error:  # noqa: BLE001 - reported to the constructor
            self._failure = error
            started.set_exception(error)
            return
        started.set_result(None)
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self._live)
                if self._live and not self._stopping.is_set():
                    self._step()
        except BaseException as error:  # noqa: BLE001 - surfaced by the next call
            self._failure = self._failure or error  # the first failure is the cause
        finally:
            self._fail_pending()
            self._llm.engine_core.shutdown()
            self._llm = None

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        self._meter.paused()
        while True:
            command, done = item
            try:
                result = command()
            except Exception as error:  # noqa: BLE001 - raised in the caller's thread
                self._publish()
                done.set_exception(error)
            else:
                # Publish before answering: a snapshot taken right after the call must show its effect
                # (the coordinator rejects a snapshot listing a request it has just interrupted).
                self._publish()
                done.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break

    def _fail_pending(self) -> None:
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if not done.done():
                done.set_exception(EngineFailed(f"{self.instance_id}: the engine stopped"))

    def _step(self) -> None:
        scheduler = self._scheduler()
        self._meter.before(scheduler, self._live)
        outputs = self._llm.step()
        generated = 0
        for output in outputs:
            generated += self._absorb(output)
        with self._lock:
            self._published.generated_tokens += generated
        self._meter.after(generated, in_process=scheduler is not None)
        self._publish()

    def _absorb(self, output: Any) -> int:
        """Append one request's new tokens (with log-probs and vLLM's versions); returns their count."""
        request = self._live.get(output.request_id)
        if request is None:  # stopped in this very step
            return 0
        completion = output.outputs[0]
        new_ids = list(completion.token_ids)
        if new_ids:
            self._meter.produced(request.request_id)
        logprobs = completion.logprobs or []
        if len(logprobs) != len(new_ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(new_ids)} tokens")
        versions = token_versions(self._llm, output, self._ids.internal(request.request_id), len(new_ids))
        for token, candidates, version in zip(new_ids, logprobs, versions):
            request.output_ids.append(token)
            request.logprobs.append(float(candidates[token].logprob))
            request.versions.append(version)
        if output.finished:
            del self._live[request.request_id]
            self._meter.produced(request.request_id)
            self._ids.forget(request.request_id)
            self._finish(request, completion.finish_reason or "stop")
        return len(new_ids)

    def _finish(self, request: RolloutRequest, reason: str) -> None:
        trajectory = Trajectory(
            request_id=request.request_id,
            group_id=request.group_id,
            prompt_ids=list(request.prompt_ids),
            output_ids=request.output_ids,
            logprobs=request.logprobs,
            versions=request.versions,
            finish_reason=reason,
            metadata=dict(request.metadata),
        )
        with self._lock:
            self._finished.append(trajectory)

    def _do_submit(self, requests: list[RolloutRequest]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        for request in requests:
            if request.request_id in self._live:
                raise ValueError(f"{self.instance_id}: request {request.request_id!r} is already running here")
            if request.group_version > self._version:
                raise ValueError(
                    f"{self.instance_id} (version {self._version}) cannot serve request "
                    f"{request.request_id!r} of group version {request.group_version}"
                )
        for original in requests:
            request = replace(
                original,
                output_ids=list(original.output_ids),
                logprobs=list(original.logprobs),
                versions=list(original.versions),
                metadata=dict(original.metadata),
            )
            if request.remaining_tokens == 0:
                self._finish(request, "length")
                continue
            params = SamplingParams(
                n=1,
                temperature=request.metadata.get(TEMPERATURE_KEY, self._sampling.temperature),
                top_p=self._sampling.top_p,
                top_k=self._sampling.top_k,
                stop_token_ids=list(self._sampling.stop_token_ids),
                ignore_eos=self._sampling.ignore_eos,
                max_tokens=request.remaining_tokens,
                logprobs=0,
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,
            )
            # rendered as vLLM asks (a raw prompt dict is deprecated in LLMEngine.add_request)
            (prompt,) = self._llm.renderer.render_cmpl([{"prompt_token_ids": request.prompt_ids + request.output_ids}])
            internal = self._llm.add_request(request.request_id, prompt, params)
            self._ids.add(internal, request.request_id)
            self._live[request.request_id] = request
            self._meter.submitted([request.request_id])

    def _do_stop(self, request_ids: list[str]) -> list[RolloutRequest]:
        stopped = [self._live.pop(rid) for rid in request_ids if rid in self._live]
        for request in stopped:
            self._meter.produced(request.request_id)
        if stopped:
            self._llm.abort_request([r.request_id for r in stopped])
            for request in stopped:
                self._ids.forget(request.request_id)
        return stopped

    def _do_load(self, version: int, source: Path | TransferWeights, update: Mapping[str, Any] | None = None) -> None:
        if version < self._version:
            raise ValueError(f"{self.instance_id}: cannot load version {version} over version {self._version}")
        try:
            if isinstance(source, TransferWeights):  # ends with set_weight_version, through finish_weight_update
                self.bytes_received += self.weight_sync.receive(source, update)  # type: ignore[union-attr]
            else:
                reload_weights_file(self._llm, source, version)
            self._version = version
            if self._verify_weights:
                verify_loaded(self._llm, self.instance_id, version, source)
        except (UpdateLeftOpenError, WeightChecksumMismatch) as error:  # its weights are not the version's: lost
            self._failure = error
            self._stopping.set()  # no step runs on them; the engine shuts down
            raise

    def weight_checksums(self, seed: int = 0) -> list[dict[str, Any]]:
        """Each tensor-parallel rank's weight layouts and checksums (:mod:`~staleflow.adapters.vllm.weight_checksum`),
        to compare with a version's weights by :func:`~staleflow.adapters.rlkit.weight_checksum.mismatches`."""
        return self._call(lambda: engine_checksums(self._llm, seed))

    def _scheduler(self) -> Any:
        """vLLM's scheduler when the engine core runs in this process (else None)."""
        core = getattr(self._llm.engine_core, "engine_core", None)
        return getattr(core, "scheduler", None)

    def _publish(self) -> None:
        scheduler = self._scheduler()
        if scheduler is not None:
            running = tuple(self._ids.ours(r.request_id) for r in scheduler.running)
            waiting = tuple(self._ids.ours(r.request_id) for r in scheduler.waiting)
            kv = kv_tokens(scheduler)
        else:  # engine core in another process: all our live requests count as running
            running, waiting = tuple(self._live), ()
            kv = sum(len(r.prompt_ids) + len(r.output_ids) for r in self._live.values())
        with self._lock:
            self._published.running = running
            self._published.waiting = waiting
            self._published.kv_tokens = kv
