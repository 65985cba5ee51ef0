"""staleflow_protocol.bindings.verl in a loop shaped like verl 0.9's fully asynchronous trainer
(``tests/verl_loop.py``: rollouter, message queue, parameter sync, fake engine): the bound on every
trained sample, exactly the consumed ids trained, the trace accepted by the standard-library
checker, a resume from verl's checkpoint folder mid-run; and verl's own count-based control on the
same job, for the comparison in docs/integrating.md.

verl's own rollouter and trainer code, with the protocol queue and with the drop-in's own classes, is
driven by ``tests/verl_real_scenario.py`` (the last tests,
markers ``verl`` and ``slow``; ``pytest -m "not verl"`` deselects them) in verl's own venv, built and
cached by ``tests/peer_venv.py``: verl 0.9.1 and the 13 packages its ``fully_async_rollouter``,
``fully_async_trainer`` and ``message_queue`` import beyond the main venv (``VERL_PACKAGES``, found
by trial, pinned, all ``--no-deps``, with setuptools for the build), and only the light package from ``protocol/``. That venv is
*shared*: it sees the main venv's site-packages (torch 2.13 CPU, ray, numpy, transformers, pyarrow...)
through a path line in a ``.pth`` file, after its own packages, and not the main venv's editable
``staleflow`` (asserted). The trade-off: verl runs there with the main venv's torch, ray and
transformers (5.x, past verl's ``<5.11`` pin), not with versions of its own; the venv holds about
120 MB instead of the 1.7 GB of a venv of its own. ``STALEFLOW_VERL_PYTHON`` overrides it with any
Python that has verl 0.9.1 (the light package is then taken from ``protocol/`` through PYTHONPATH)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from staleflow.protocol.bindings.verl import CHECKPOINT_FILE, Admission, ProtocolMessageQueue, protocol_settings, wait_admitted
from staleflow.protocol.check import check_trace
from staleflow.protocol.trace import JsonlTraceWriter, read_trace

from tests.peer_venv import peer_command, peer_python
from tests.verl_loop import FakeEngine, RunResult, VerlCountControl, run_loop

ETA, BATCH, CONCURRENT = 1, 4, 12


def _assert_bound(result: RunResult, eta: int, first_step: int, steps: int) -> None:
    assert [b for b, _ in result.trained] == list(range(first_step, first_step + steps))
    ids = [s.sample_id for _, samples in result.trained for s in samples]
    assert len(ids) == len(set(ids)) == steps * BATCH
    for b, samples in result.trained:
        assert all(s.version <= b <= s.version + eta for s in samples), (b, samples)


def test_protocol_queue_bounds_every_trained_sample_and_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    """30 steps, a checkpoint into verl's global_step_30 folder, a fresh queue restored from it
    (the in-flight samples aborted, as verl's checkpoint loses them), 25 more steps."""
    trace = tmp_path / "verl-trace.jsonl"
    folder = tmp_path / "ckpt" / "global_step_30"

    async def first() -> tuple[RunResult, dict[str, object]]:
        queue = ProtocolMessageQueue(*protocol_settings(2, 2, 1, staleness_threshold=0.5), redundancy=1)
        assert (queue.manager.eta, queue.manager.batch_size) == (ETA, BATCH)
        writer = JsonlTraceWriter.attach(queue.manager, trace, refusals=True)

        async def save(version: int) -> None:
            if version == 30:
                await queue.save_checkpoint(str(folder))

        result = await run_loop(queue, FakeEngine(seed=1), 30, max_concurrent=CONCURRENT, on_step=save)
        writer.close()
        return result, await queue.get_statistics()

    before, stats = asyncio.run(first())
    _assert_bound(before, ETA, 0, 30)
    assert before.staleness().get(ETA, 0) > 0  # stale samples trained, none past the bound
    assert stats["total_consumed"] == 30 * BATCH and stats["param_version"] == 30
    saved = json.loads((folder / CHECKPOINT_FILE).read_text())
    assert saved["version"] == 30 and saved["groups"]  # samples were in flight at the checkpoint

    async def resumed() -> tuple[RunResult, list[object]]:
        queue = ProtocolMessageQueue()
        lost = await queue.load_checkpoint(str(folder), param_version=30)
        assert len(queue.manager) == 0 and queue.manager.version == 30
        writer = JsonlTraceWriter.attach(queue.manager, trace, mode="a", refusals=True)
        engine = FakeEngine(seed=2)
        engine.version = 30  # verl's trainer reloads global_step_30 and syncs the replicas
        result = await run_loop(queue, engine, 25, max_concurrent=CONCURRENT, start_step=30, epoch=1)
        writer.close()
        return result, lost

    after, lost = asyncio.run(resumed())
    assert sorted(lost) == sorted(g[0] for g in saved["groups"])
    _assert_bound(after, ETA, 30, 25)
    report = check_trace(trace)
    assert report.accepted, (report.offending, report.reason)
    events = [e for s in read_trace(trace) for e in s.events]
    assert len(read_trace(trace)) == 2
    assert sum(e.op == "consume" for e in events) == 55 and any(e.op == "abort" for e in events)
    checked = subprocess.run([sys.executable, "-m", "staleflow.protocol.check", str(trace)],
                             capture_output=True, text=True, check=False, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_checkpoint_of_another_parameter_version_is_refused(tmp_path: Path) -> None:
    """Misuse raises a ``ProtocolError`` naming the problem (with the ``ValueError``/``TypeError``
    bases callers catch), before anything changes."""
    from staleflow.protocol import InvalidGroupIdError, InvalidParameterError, InvalidVersionError, SnapshotError

    async def go() -> None:
        queue = ProtocolMessageQueue(eta=1, batch_size=2)
        await queue.save_checkpoint(str(tmp_path))
        with pytest.raises(SnapshotError, match="verl resumes at parameter version 3, the protocol snapshot at 0"):
            await queue.load_checkpoint(str(tmp_path), param_version=3)
        with pytest.raises(InvalidVersionError, match="one protocol batch must be one parameter version"):
            await queue.param_synced(1)
        assert await queue.try_reserve("s0", 0) is Admission.ADMITTED
        with pytest.raises(InvalidGroupIdError, match="put_sample needs the sample_id"):
            await queue.put_sample({"id": "s0"})
        assert (await queue.get_statistics())["active"] == 1 and await queue.get_queue_size() == 0

    asyncio.run(go())
    with pytest.raises(InvalidParameterError, match="staleness_threshold must be >= 0"):
        protocol_settings(2, 1, 1, staleness_threshold=-1)
    assert issubclass(SnapshotError, ValueError) and issubclass(InvalidGroupIdError, TypeError)


def test_get_sample_hands_out_exactly_the_consumed_ids_and_late_samples_are_refused() -> None:
    """verl's trainer pulls one sample at a time: it gets the batch's ids in batch order, a sample
    of a dropped group is refused at put_sample, and shutdown ends get_sample with None. The queue is
    built outside the event loop that uses it, as Ray builds an actor."""
    queue = ProtocolMessageQueue(eta=0, batch_size=2, redundancy=1)

    async def go() -> None:
        assert [await queue.try_reserve(g, 0) for g in "abc"] == [Admission.ADMITTED] * 3
        assert await queue.try_reserve("d", 0) is Admission.WAIT  # buffer 0 is full: no room now
        assert not await wait_admitted(queue.try_reserve, "d", 0, timeout=0.01)  # the caller waits, times out
        for g in "ba":
            assert await queue.put_sample({"id": g}, sample_id=g)
        assert [(await queue.get_sample())[0]["id"] for _ in range(2)] == ["b", "a"]  # type: ignore[index]
        assert await queue.param_synced(1) == ["c"]  # c was due in batch 0: dropped
        assert not await queue.put_sample({"id": "c"}, sample_id="c") and queue.refused_late == 1
        assert await queue.try_reserve("e", 0) is Admission.STALE  # version 0 is past every deadline: sync first
        assert not await wait_admitted(queue.try_reserve, "e", 0)
        waiting = asyncio.ensure_future(queue.get_sample())  # the trainer waits for batch 1 ...
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await queue.put_sample(None)  # ... and verl's end signal wakes it
        assert await asyncio.wait_for(waiting, 5) is None
        assert await queue.get_sample() is None

    asyncio.run(go())


def test_verl_count_control_trains_samples_past_the_bound_on_the_same_job() -> None:
    """The same fake-engine job under verl's own rule (staleness_threshold = eta = 1): the count
    limits samples started per version, the FIFO queue trains slow samples late. The protocol on the
    same seeds trains none past eta (the test above); the numbers are in docs/integrating.md."""
    past, total = 0, 0
    for seed in range(3):
        result = asyncio.run(run_loop(VerlCountControl(BATCH, staleness_threshold=ETA), FakeEngine(seed), 50,
                                      max_concurrent=CONCURRENT))
        past += result.past(ETA)
        total += sum(len(s) for _, s in result.trained)
    assert total == 3 * 50 * BATCH
    assert past > 0, "verl's count control kept the bound on this job: the comparison no longer shows anything"


def test_the_guides_verl_example_runs_on_the_light_package_alone(tmp_path: Path) -> None:
    """The verl section's block of docs/integrating.md, run against ``staleflow_protocol`` (the protocol
    folder under the light package's name), prints what its comments say and imports no staleflow."""
    import re

    guide = (Path(__file__).resolve().parents[1] / "docs" / "integrating.md").read_text()
    section = guide[guide.index("\n## 8. verl"):]
    [block] = re.findall(r"```python verl\n(.*?)```", section, flags=re.DOTALL)
    expected = ["12 12 6", "[] 6"]
    for line in expected:
        assert f"# {line}" in block
    (tmp_path / "staleflow_protocol").symlink_to(Path(__file__).resolve().parents[1] / "protocol")
    (tmp_path / "example.py").write_text(block + "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('staleflow.')))\n")
    done = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, check=False, timeout=120,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [*expected, "[]"]


def test_get_batch_waits_on_when_a_stale_reserve_disables_consume_after_the_wake_up() -> None:
    """Between the wake-up of a waiting get_batch and its task running, an engine still on the
    previous version reserves a sample due in the head buffer: consume is disabled again, and
    get_batch must wait on (it returned None, "no batch", when verl's own rollouter drove it)."""

    async def go(turns: int) -> None:
        queue = ProtocolMessageQueue(eta=1, batch_size=1)
        assert await queue.try_reserve("x", 0) is Admission.ADMITTED and await queue.put_sample("x", sample_id="x")
        assert (await queue.get_batch()).batch.group_ids == ("x",)  # type: ignore[union-attr]
        waiting = asyncio.ensure_future(queue.get_batch())
        await asyncio.sleep(0.01)
        assert await queue.try_reserve("a", 1) is Admission.ADMITTED and await queue.put_sample("a", sample_id="a")  # wakes get_batch
        for _ in range(turns):  # the waiter sees consume enabled; get_batch has not run yet
            await asyncio.sleep(0)
        if waiting.done():
            return  # get_batch ran first: nothing to race with
        assert await queue.try_reserve("b", 0) is Admission.ADMITTED  # b is due in batch 1 and still running
        assert not queue.manager.can_consume()
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert await queue.put_sample("b", sample_id="b")
        got = await asyncio.wait_for(waiting, 5)
        assert got is not None and got.batch.group_ids == ("b",) and got.samples == ["b"]

    for turns in range(4):
        asyncio.run(go(turns))


#: What verl 0.9.1's fully_async_policy modules import beyond the main venv (found by trial), pinned,
#: installed --no-deps (setuptools: the light package's build requirement, ensurepip's is older).
VERL_PACKAGES = [
    "verl==0.9.1", "tensordict==0.15.3", "pyvers==0.2.3", "omegaconf==2.4.0", "hydra-core==1.3.8",
    "antlr4-python3-runtime==4.9.3", "codetiming==1.4.0", "orjson==3.13.0", "torchdata==0.11.0", "datasets==5.2.0",
    "multiprocess==0.70.19", "pandas==3.1.1", "peft==0.21.2", "accelerate==1.16.0", "setuptools==78.1.1",
]


@pytest.fixture(scope="module")
def verl_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """A Python with verl 0.9.1 and the light package, and the environment to run it in."""
    import os

    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    override = os.environ.get("STALEFLOW_VERL_PYTHON")
    if override:
        light = tmp_path_factory.mktemp("light")
        (light / "staleflow_protocol").symlink_to(Path(__file__).resolve().parents[1] / "protocol")
        return override, {**env, "PYTHONPATH": str(light)}
    python, seconds = peer_python("verl", [], VERL_PACKAGES, shared=True)
    print(f"verl venv: {seconds:.1f} s")
    return str(python), env


@pytest.mark.verl
@pytest.mark.slow
def test_verl_venv_has_verl_and_the_light_package_and_not_staleflow(verl_python: tuple[str, dict[str, str]],
                                                                    tmp_path: Path) -> None:
    python, env = verl_python
    probe = ("import importlib.util, json, sys, verl, torch, staleflow_protocol.bindings.verl as v\n"
             "try:\n    import staleflow\n    found = staleflow.__file__\nexcept ImportError:\n    found = None\n"
             "print(json.dumps([verl.__version__, torch.__version__, found, v.__name__, "
             "sorted(m for m in sys.modules if m.split('.')[0] == 'staleflow')]))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["0.9.1", "2.13.0+cpu", None, "staleflow_protocol.bindings.verl", []]


@pytest.mark.verl
@pytest.mark.slow
def test_verls_own_rollouter_and_trainer_code_with_the_protocol_queue_and_the_drop_in(verl_python: tuple[str, dict[str, str]],
                                                                                     tmp_path: Path) -> None:
    """tests/verl_real_scenario.py in verl's venv, three modes in one process: verl's own
    ``_processor_worker`` and ``_get_samples_from_queue`` with ``ProtocolMessageQueue`` (50 steps, no
    sample past eta, the trace accepted); verl's own queue and count on the same seed (samples past
    eta); and the drop-in's classes (``ProtocolQueue`` from a verl config, ``ProtocolQueueClient``,
    the rollouter and trainer mixins) on verl's own loop code, with redundancy and a weight push that
    takes time: no sample past eta, none reserved under a newer version than the weights it ran on,
    the dropped samples never trained and those still generating cancelled, the queue checkpointed
    into verl's ``global_step_25`` folder and resumed from it by a new queue, rollouter and trainer."""
    python, env = verl_python
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(peer_command(python, str(root / "tests" / "verl_real_scenario.py"), "dropin,protocol,verl", str(tmp_path), "0"),
                          capture_output=True, text=True, check=False, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    past, results = {}, {}
    for mode in ("protocol", "verl", "dropin"):
        results[mode] = result = json.loads((tmp_path / mode / "result.json").read_text())
        assert [b["version"] for b in result["trained"]] == list(range(50))
        ids = [sample_id for b in result["trained"] for sample_id, *_ in b["samples"]]
        assert len(ids) == len(set(ids)) == 200
        assert all(v <= b["version"] for b in result["trained"] for _, v, *_ in b["samples"])
        past[mode] = sum(b["version"] - v > 1 for b in result["trained"] for _, v, *_ in b["samples"])
    assert past == {"protocol": 0, "verl": past["verl"], "dropin": 0} and past["verl"] > 0, past
    dropin = results["dropin"]
    # each push takes time (generations go on meanwhile): a sample is reserved under the version its
    # weights have, never a newer one (a label raised before the push completes), and trained within eta of it
    samples = [(b["version"], *sample) for b in dropin["trained"] for sample in b["samples"]]
    assert all(reserved <= weights for _, _, weights, reserved in samples), "reserved under a newer version than its weights"
    assert all(reserved <= version <= reserved + 1 for version, _, _, reserved in samples)
    trained = [sample_id for b in dropin["trained"] for sample_id, *_ in b["samples"]]
    assert all(i.startswith("sample_0_") for i in trained[:100]) and all(i.startswith("sample_1_") for i in trained[100:])
    assert dropin["dropped"] and not set(dropin["dropped"]) & set(trained)
    generating, cancelled = dropin["generating"]
    assert cancelled == generating > 0  # each dropped sample still generating was cancelled
    assert sum(s["dropped_samples"] for s in dropin["stats"]) == len(dropin["dropped"])
    assert [(s["param_version"], s["total_consumed"]) for s in dropin["stats"]] == [(25, 100), (50, 100)]
    assert dropin["checkpoint"] == ["global_step_25", "global_step_25/actor", "global_step_25/staleflow_protocol.json",
                                    "latest_checkpointed_iteration.txt"]
    traces = [str(tmp_path / mode / "trace.jsonl") for mode in ("protocol", "dropin")]
    checked = subprocess.run(peer_command(python, "-m", "staleflow_protocol.check", *traces),
                             capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "in 2 segment(s)" in checked.stdout.splitlines()[-1], checked.stdout


@pytest.mark.ray
def test_the_queue_as_verl_hosts_its_own_an_async_ray_actor_killed_and_resumed(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``ray.remote(num_cpus=1, max_concurrency=20)(ProtocolMessageQueue)``, as verl hosts its
    ``MessageQueue``: four rollouter workers reserve (waiting on their side until admitted) at the
    current parameter version, generate for a random, long-tailed time across syncs and put their
    samples; the trainer takes its batches with ``get_sample`` and calls ``param_synced``. After step
    9 the trainer saves verl's ``global_step_10`` folder, the actor is killed with generations in
    flight, and a new actor with the same ``trace_path`` loads the checkpoint and trains steps 10-19.
    The bound holds on every trained sample, each id is trained once, and the trace (two segments,
    one per actor) is accepted and holds the consumes of all 20 batches."""
    import random

    from staleflow.protocol.check import check_trace

    ray = ray_cluster
    queue_actor = ray.remote(num_cpus=1, max_concurrency=20)(ProtocolMessageQueue)
    trace, folder = tmp_path / "verl-trace.jsonl", tmp_path / "ckpt" / "global_step_10"
    settings = protocol_settings(2, 2, 1, staleness_threshold=1)
    trained: list[tuple[int, dict[str, int]]] = []
    counter = iter(range(10**6))

    async def life(queue, first_step: int, steps: int) -> None:  # type: ignore[no-untyped-def]
        param_version = first_step

        async def rollouter(worker: int) -> None:
            rng = random.Random(worker + first_step)
            while True:
                sample_id, started = f"sample_{next(counter)}", param_version
                if not await wait_admitted(queue.try_reserve.remote, sample_id, started):
                    await asyncio.sleep(0.001)  # too old: wait for the parameter sync
                    continue
                await asyncio.sleep(rng.choice([0.001, 0.002, 0.004, 0.03]))  # generate; some outlast a sync
                await queue.put_sample.remote({"id": sample_id, "version": started}, sample_id=sample_id)

        workers = [asyncio.ensure_future(rollouter(k)) for k in range(4)]
        for step in range(first_step, first_step + steps):
            for _ in range(settings.batch_size):
                sample, _queued = await queue.get_sample.remote()
                trained.append((step, sample))
            param_version = step + 1  # the replicas get the new weights
            await queue.param_synced.remote(param_version)
        await queue.save_checkpoint.remote(str(folder))
        for worker in workers:  # generations still in flight when the actor dies
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    first = queue_actor.remote(*settings, trace_path=str(trace))
    asyncio.run(life(first, 0, 10))
    in_flight = ray.get(first.get_statistics.remote())["active"]
    ray.kill(first)
    second = queue_actor.remote(trace_path=str(trace))
    lost = ray.get(second.load_checkpoint.remote(str(folder), param_version=10))
    asyncio.run(life(second, 10, 10))
    ray.get(second.shutdown.remote())  # writes the trace out
    ray.kill(second)

    assert in_flight > 0 and len(lost) > 0  # the kill did interrupt admitted samples; the resume aborted them
    assert [step for step, _ in trained] == [step for step in range(20) for _ in range(settings.batch_size)]
    assert all(s["version"] <= step <= s["version"] + settings.eta for step, s in trained)
    assert any(step - s["version"] == settings.eta for step, s in trained)  # partials across a sync: the bound was exercised
    ids = [s["id"] for _, s in trained]
    assert len(ids) == len(set(ids)) and not set(lost) & set(ids)
    report = check_trace(trace)
    assert report.accepted, report
    segments = read_trace(trace)
    assert len(segments) == 2
    assert sorted(e.batch.version for seg in segments for e in seg.events if e.batch is not None) == list(range(20))


@pytest.mark.ray
def test_a_hundred_rollouter_callers_never_stall_the_queue_hosted_as_verl_hosts_its_own(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """verl hosts its ``MessageQueue`` with ``max_concurrency=20``. A ``reserve`` that waited inside the
    actor held one of those 20 slots: with 24 callers or more every slot was a waiting reserve,
    ``put_sample`` and ``get_sample`` never ran, and the run stalled at step 0 (100 callers: no batch in
    30 s). ``try_reserve`` answers at once and the callers wait on their side (``wait_admitted``),
    reading the version their weights are on at every ask; 100 of them run 10 steps of 4 samples
    within the bound, each id trained once."""
    ray = ray_cluster
    queue = ray.remote(num_cpus=1, max_concurrency=20)(ProtocolMessageQueue).remote(eta=1, batch_size=4)
    callers, steps, state = 100, 10, {"version": 0, "step": 0}
    trained: list[tuple[int, dict[str, Any]]] = []

    async def rollouter(worker: int) -> None:
        for n in range(10**6):
            sample_id, asked = f"sample_{worker}_{n}", []

            def loaded_version(asked: list[int] = asked) -> int:  # the rollouter's weights, read at every ask
                asked.append(state["version"])
                return asked[-1]

            await wait_admitted(queue.try_reserve.remote, sample_id, loaded_version)
            started = asked[-1]  # the version of the ask that admitted it
            await asyncio.sleep(0.001 * (worker % 5))  # generate
            await queue.put_sample.remote({"id": sample_id, "version": started}, sample_id=sample_id)

    async def trainer() -> None:
        for step in range(steps):
            for _ in range(4):
                sample, _queued = await queue.get_sample.remote()
                trained.append((step, sample))
            state["version"] = state["step"] = step + 1  # the replicas get the new weights
            await queue.param_synced.remote(step + 1)

    async def run() -> None:
        workers = [asyncio.ensure_future(rollouter(k)) for k in range(callers)]
        try:
            await asyncio.wait_for(trainer(), 60)
        except TimeoutError:
            pytest.fail(f"{callers} reserve callers stalled the queue at step {state['step']} (no batch in 60 s)")
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    asyncio.run(run())
    ray.kill(queue)
    assert [step for step, _ in trained] == [step for step in range(steps) for _ in range(4)]
    assert all(s["version"] <= step <= s["version"] + 1 for step, s in trained)
    assert len({s["id"] for _, s in trained}) == steps * 4


def _dropin_run(python: str, env: dict[str, str], mode: str, out: Path, total: int) -> list[dict[str, Any]]:
    """tests/verl_dropin_run.py in verl's venv; the local steps it trained (all runs into ``out`` so far)."""
    script = Path(__file__).resolve().parent / "verl_dropin_run.py"
    done = subprocess.run(peer_command(python, str(script), mode, str(out), str(total)), capture_output=True, text=True, check=False,
                          timeout=1200, cwd=out.parent, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]


@pytest.mark.verl
@pytest.mark.slow
@pytest.mark.nightly  # 210 s of CI's 15 minutes on 2 cores: pytest -m nightly
@pytest.mark.timeout(3600)  # three runs of verl's task runner, each starting four Ray processes that import verl
def test_verls_own_fully_async_main_with_the_drop_in_keeps_the_bound_on_the_loaded_weights(
        verl_python: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    """verl's ``fully_async_main`` path (its task runner, Ray actors, weight-push order, checkpoints)
    with ``use_protocol`` and verl's default concurrency (16 samples per replica), GPU parts stood
    in (tests/verl_dropin_run.py): 100 prompts (6 versions of 16), then a resume from verl's
    ``global_step_6`` folder to 200. Every sample is trained within eta of the version it reserved
    under, and that version is never newer than the weights it was generated on; the trace of both
    runs is accepted. Reserving under the protocol's version instead (raised before the push) puts
    samples of old weights under newer versions, and the same check catches it."""
    python, env = verl_python
    out = tmp_path / "dropin"
    first = _dropin_run(python, env, "dropin", out, 100)
    assert [step["version"] for step in first] == [v for v in range(6) for _ in range(4)]
    assert (out / "ckpt" / "global_step_6" / CHECKPOINT_FILE).exists() and (out / "ckpt" / "global_step_6" / "data.pt").exists()
    both = _dropin_run(python, env, "dropin", out, 200)
    resumed = both[len(first):]
    assert [step["version"] for step in resumed] == [v for v in range(6, 12) for _ in range(4)]
    for run in (first, resumed):
        samples = [(step["version"], *sample) for step in run for sample in step["samples"]]
        assert len({sample_id for _, sample_id, _, _ in samples}) == len(samples) == len(run) * 4
        assert all(reserved <= version <= reserved + 1 for version, _, reserved, _ in samples), samples
        assert all(reserved <= weights for _, _, reserved, weights in samples), "reserved under a newer version than its weights"
    checked = subprocess.run(peer_command(python, "-m", "staleflow_protocol.check", str(out / "trace.jsonl")),
                             capture_output=True, text=True,
                             check=False, timeout=120, cwd=tmp_path, env=env)
    assert checked.returncode == 0 and "2 segment" in checked.stdout, checked.stdout + checked.stderr
    label = _dropin_run(python, env, "label", tmp_path / "label", 100)
    assert any(reserved > weights for step in label for _, reserved, weights in step["samples"])
