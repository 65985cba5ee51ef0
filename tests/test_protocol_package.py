"""The protocol as a library for other RL systems (issue 12): its own dependency-free distribution
(installed offline into a fresh venv), Python 3.9 compatibility, the standard-library trace checker
run as a module, and the thread-safe wrapper under concurrent use."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import venv
import zipfile
from pathlib import Path

import pytest
from skips import require
from staleflow import protocol
from staleflow.protocol import (
    LockedStalenessManager,
    ProtocolEvent,
    StalenessManager,
    check,
)
from staleflow.protocol.check import replay_events
from staleflow.protocol.trace import TraceFormatError, read_trace

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "protocol"
#: pip's options for the documented offline build (docs/integrating.md, "Install")
OFFLINE_BUILD = ("--check-build-dependencies", "--no-deps", "--no-build-isolation", "--no-index")


def _run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], check=False, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _installed_version(python: str | Path, name: str) -> str:
    """The version of distribution ``name`` that a new process of ``python`` finds, or ``"none"``."""
    probe = f"import importlib.metadata as m\ntry: print(m.version({name!r}))\nexcept m.PackageNotFoundError: print('none')"
    return _run(python, "-I", "-c", probe, env=CLEAN_ENV).stdout.strip()


def _random_trace(manager: StalenessManager | LockedStalenessManager, ops: int, seed: int) -> None:
    """A seeded producer/trainer that issues only valid calls (refused reserves included)."""
    rng = random.Random(seed)
    next_id = 0
    for _ in range(ops):
        running = [g.group_id for g in manager.groups() if g.status.value == "running"]
        roll = rng.random()
        if roll < 0.45:
            manager.reserve(f"g{next_id}", max(0, manager.version - rng.randint(0, manager.eta + 1)))
            next_id += 1
        elif roll < 0.8 and running:
            manager.occupy(rng.choice(running))
        elif roll < 0.85 and running:
            manager.abort(rng.choice(running))
        elif manager.can_consume():
            manager.consume()


# ----------------------------------------------------------------------------- distribution


@pytest.fixture(scope="module")
def light_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The light distribution's wheel, built offline from a copy of protocol/ (no network, no deps)."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "src"
    shutil.copytree(PROTOCOL, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    built = _run(sys.executable, "-m", "pip", "wheel", *OFFLINE_BUILD, "--disable-pip-version-check", "-w", out / "dist", source)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (out / "dist").glob("staleflow_protocol-*.whl")
    return wheel


def test_light_wheel_holds_exactly_the_protocol_sources(light_wheel: Path) -> None:
    """The same files as staleflow.protocol, not a copy that could drift; no dependencies, Python >= 3.9."""
    assert Path(protocol.__file__).parent.resolve() == PROTOCOL
    sources = sorted(p.relative_to(PROTOCOL).as_posix() for p in PROTOCOL.rglob("*.py") if "build" not in p.parts)
    assert {"check.py", "locked.py", "mirror.py", "manager.py", "trace.py", "bindings/verl.py"} <= set(sources)
    with zipfile.ZipFile(light_wheel) as wheel:
        packaged = sorted(n.removeprefix("staleflow_protocol/") for n in wheel.namelist()
                          if n.startswith("staleflow_protocol/") and n.endswith(".py"))
        assert packaged == sources
        for name in sources:
            assert wheel.read(f"staleflow_protocol/{name}") == (PROTOCOL / name).read_bytes()
        [metadata] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        text = wheel.read(metadata).decode()
    assert "Requires-Python: >=3.9" in text
    # no dependency; only the `areal` extra declares one (for staleflow_protocol.bindings.areal)
    assert [line for line in text.splitlines() if line.startswith("Requires-Dist")] == [
        'Requires-Dist: areal<1.1,>=1.0.4; extra == "areal"']


def test_light_package_builds_offline_with_setuptools_alone(tmp_path: Path) -> None:
    """The stated build requirement (setuptools >= 70.1, no `wheel` package) is what the build needs:
    it builds with build isolation off and no index in this venv, which has no `wheel` package."""
    import re
    from importlib.metadata import version

    pyproject = (PROTOCOL / "pyproject.toml").read_text()
    [requires] = re.findall(r"^requires = (.*)$", pyproject, flags=re.MULTILINE)
    assert json.loads(requires) == ["setuptools>=70.1"]
    assert tuple(int(p) for p in version("setuptools").split(".")[:2]) >= (70, 1)
    # Asked in a new process, as the build's own Python sees the venv: in this one, once any test has
    # imported setuptools, its vendored copy of `wheel` (setuptools/_vendor) is on sys.path and would be
    # found, so the check skipped this test in every whole-suite run.
    installed = _installed_version(sys.executable, "wheel")
    if installed != "none":
        pytest.skip(f"the `wheel` package ({installed}) is installed here; scripts/setup.sh's venv has none")
    source = tmp_path / "src"
    shutil.copytree(PROTOCOL, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {**CLEAN_ENV, "PIP_NO_INDEX": "1"}
    built = _run(sys.executable, "-m", "pip", "wheel", *OFFLINE_BUILD, "--disable-pip-version-check", "-w", tmp_path / "dist",
                 source, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    assert len(list((tmp_path / "dist").glob("staleflow_protocol-0.1.0-py3-none-any.whl"))) == 1


def test_the_offline_build_refuses_a_fresh_venvs_setuptools_by_name(light_venv: Path, tmp_path: Path) -> None:
    """A venv made by ``python -m venv`` has setuptools older than the floor (3.11: 65.5, which needs the
    ``wheel`` package for ``bdist_wheel``) or none (3.12 on). The documented offline command stops
    before building and names the requirement, instead of failing inside the build with ``invalid
    command 'bdist_wheel'``; docs/python.md and the guide give that command."""
    found = _installed_version(light_venv, "setuptools")
    if found != "none" and tuple(int(p) for p in found.split(".")[:2]) >= (70, 1):
        pytest.skip(f"this Python's venv comes with setuptools {found}, at the floor already")
    source = tmp_path / "src"
    shutil.copytree(PROTOCOL, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {**CLEAN_ENV, "PIP_NO_INDEX": "1"}
    refused = _run(light_venv, "-m", "pip", "install", *OFFLINE_BUILD, "--disable-pip-version-check", source, env=env)
    assert refused.returncode != 0
    assert "setuptools>=70.1" in refused.stderr, refused.stdout + refused.stderr
    assert "bdist_wheel" not in refused.stdout + refused.stderr  # refused before any build step ran
    command = "pip install " + " ".join(OFFLINE_BUILD) + " ./protocol"
    assert command in " ".join((ROOT / "docs" / "integrating.md").read_text().split())
    wheel = "pip wheel --check-build-dependencies --no-build-isolation --no-deps --no-index ./protocol"
    assert wheel in (ROOT / "docs" / "python.md").read_text()


@pytest.fixture(scope="module")
def light_venv(light_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the light wheel installed (pip install --no-index): its python."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    installed = _run(python, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", light_wheel)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.slow
def test_light_package_installs_alone_in_a_fresh_venv_offline(light_venv: Path, tmp_path: Path) -> None:
    """pip install --no-index into a new venv: nothing else comes along, it works, and it checks traces."""
    listing = _run(light_venv, "-m", "pip", "list", "--format=json", "--disable-pip-version-check")
    names = {p["name"].lower() for p in json.loads(listing.stdout)}
    assert names - {"pip", "setuptools", "wheel"} == {"staleflow-protocol"}
    script = tmp_path / "use.py"
    script.write_text(
        "import sys\n"
        "from staleflow_protocol import LockedStalenessManager\n"
        "m = LockedStalenessManager.create(eta=1, batch_size=2)\n"
        "w = m.attach_trace(sys.argv[1])\n"
        "print([m.reserve(g, 0) for g in 'abcde'])\n"
        "m.occupy('a'); m.occupy('b')\n"
        "print(m.try_consume().group_ids)\n"
        "w.close()\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('staleflow', 'torch', 'numpy')))\n"
    )
    trace = tmp_path / "trace.jsonl"
    used = _run(light_venv, "-I", script, trace, cwd=tmp_path, env=CLEAN_ENV)
    assert used.returncode == 0, used.stderr
    assert used.stdout.splitlines() == ["[True, True, True, True, False]", "('a', 'b')", "[]"]
    checked = _run(light_venv, "-I", "-m", "staleflow_protocol.check", trace, cwd=tmp_path, env=CLEAN_ENV)
    # 7 events: the refused reserve is counted, not traced
    assert (checked.returncode, checked.stdout.strip()) == (0, f"{trace}: accepted (7 events in 1 segment(s))")
    script_checked = _run(light_venv.parent / "staleflow-check-trace", trace, cwd=tmp_path, env=CLEAN_ENV)
    assert (script_checked.returncode, script_checked.stdout) == (0, checked.stdout)


#: What each ``python`` block of docs/integrating.md prints (its comments say the same).
GUIDE_OUTPUT = [
    ["refused p4", "0 ('p1', 'p0') ()", "True True",
     "1 [('p3', 0, 'running'), ('p5', 1, 'running'), ('p6', 1, 'running')]"],
    ["0 True", "True True"],
    ["12 6 12"],
    ["0 run.jsonl: accepted (4 events in 1 segment(s))",
     "1 bad.jsonl: REJECTED at segment 1: event #1 (line 3, seq 1, reserve('b', v=0)): "
     "reserve('b', v=0) accepted but Reserve is disabled",
     "[('reserve', 'a', True), ('reserve', 'b', False), ('occupy', 'a', None), ('consume', None, None)]",
     "('a',) 0 1"],
]


@pytest.mark.slow
def test_integration_guide_examples_run_on_the_light_package(light_venv: Path, tmp_path: Path) -> None:
    import re

    guide = (ROOT / "docs" / "integrating.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    assert len(blocks) == len(GUIDE_OUTPUT)
    for number, (block, expected) in enumerate(zip(blocks, GUIDE_OUTPUT)):
        for line in expected:  # the guide's comments show the output
            assert f"# {line}" in block, (number, line)
        script = tmp_path / f"example{number}.py"
        script.write_text(block)
        done = _run(light_venv, "-I", script, cwd=tmp_path, env=CLEAN_ENV)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == expected, number


@pytest.mark.slow
@pytest.mark.ray
def test_integration_guide_ray_actor_loop_runs_as_written(tmp_path: Path) -> None:
    """The guide's Ray-actor block (a threaded actor holding a ``LockedStalenessManager``, rollout
    tasks blocking in ``reserve``, the driver blocking in ``next_batch``) runs as printed with Ray and
    ``staleflow_protocol`` (the protocol folder under the light package's name) and prints what it
    says; it imports nothing of ``staleflow``."""
    import re

    guide = (ROOT / "docs" / "integrating.md").read_text()
    [block] = re.findall(r"```python ray\n(.*?)```", guide, flags=re.DOTALL)
    assert "# 12 12" in block
    (tmp_path / "staleflow_protocol").symlink_to(PROTOCOL)
    (tmp_path / "example.py").write_text(block + "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith('staleflow.')))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    done = _run(sys.executable, "example.py", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["12 12", "[]"]


def test_protocol_sources_need_only_python_3_9() -> None:
    """vermin (a pinned dev tool) finds every construct's minimum version; it must be <= 3.9."""
    require("vermin", "dev")
    ok = _run(sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--violations", "-t=3.9-", PROTOCOL)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # the check can fail: the two 3.10+/3.11+ constructs the package used before issue 12
    bad = PROTOCOL.parent / ".pytest_cache" / "vermin_probe.py"
    bad.parent.mkdir(exist_ok=True)
    bad.write_text("from dataclasses import dataclass\nfrom typing import Self\n"
                   "@dataclass(frozen=True, slots=True)\nclass A:\n    x: int\n")
    try:
        failed = _run(sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--violations", "-t=3.9-", bad)
    finally:
        bad.unlink()
    assert failed.returncode != 0 and "typing.Self" in failed.stdout and "slots" in failed.stdout


def test_spec_mirror_is_the_light_package_mirror() -> None:
    from staleflow.protocol import mirror
    from staleflow.spec import mirror as spec_mirror

    assert spec_mirror.reserve is mirror.reserve and spec_mirror.MirrorState is mirror.MirrorState


# ----------------------------------------------------------------------------- trace checker


def _check(*paths: Path) -> subprocess.CompletedProcess[str]:
    return _run(sys.executable, "-m", "staleflow.protocol.check", *paths)


@pytest.fixture()
def good_trace(tmp_path: Path) -> Path:
    manager = StalenessManager(eta=2, batch_size=3, redundancy=1)
    path = tmp_path / "good.jsonl"
    writer = protocol.trace.JsonlTraceWriter.attach(manager, path, refusals=True)
    _random_trace(manager, 600, seed=3)
    writer.close()
    # a second segment after a restore (a resumed run appends to the same file)
    resumed = StalenessManager.restore(manager.snapshot())
    with protocol.trace.JsonlTraceWriter.attach(resumed, path, mode="a", refusals=True):
        _random_trace(resumed, 200, seed=4)
    return path


def test_checker_accepts_a_real_trace(good_trace: Path) -> None:
    segments = read_trace(good_trace)
    events = [e for s in segments for e in s.events]
    assert len(segments) == 2 and any(e.op == "consume" and e.batch and e.batch.dropped for e in events)
    assert any(e.op == "reserve" and e.accepted is False for e in events)
    done = _check(good_trace)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"{good_trace}: accepted ({len(events)} events in 2 segment(s))"


def _rewrite(path: Path, out: Path, edit: object) -> tuple[int, dict[str, object]]:
    """Apply ``edit(event) -> bool`` to the first event line it accepts; returns (event index, event)."""
    lines = path.read_text().splitlines()
    index = -1
    for number, line in enumerate(lines):
        data = json.loads(line)
        if data.get("type") == "header":
            continue
        index += 1
        if edit(data):  # type: ignore[operator]
            lines[number] = json.dumps(data)
            out.write_text("\n".join(lines) + "\n")
            return index, data
    raise AssertionError("no event to corrupt")


def test_checker_rejects_a_refused_reserve_logged_as_accepted(good_trace: Path, tmp_path: Path) -> None:
    def flip(e: dict[str, object]) -> bool:
        if e["op"] == "reserve" and e["accepted"] is False:
            e["accepted"] = True
            return True
        return False

    bad = tmp_path / "flipped.jsonl"
    index, event = _rewrite(good_trace, bad, flip)
    done = _check(bad)
    assert done.returncode == 1
    assert f"REJECTED at segment 1: event #{index} (line {index + 2}, seq {event['seq']}, reserve(" in done.stdout
    assert "accepted but Reserve is disabled" in done.stdout


def test_checker_rejects_a_batch_that_trains_a_running_group(good_trace: Path, tmp_path: Path) -> None:
    """A FIFO consumer that trains a group the protocol did not give it: the batch is not a Consume step."""
    segment = read_trace(good_trace)[0]
    running: dict[object, int] = {}
    target = None
    for e in segment.events:
        if e.op == "reserve" and e.accepted:
            running[e.group_id] = e.version or 0
        elif e.op in ("occupy", "abort"):
            running.pop(e.group_id, None)
        elif e.op == "consume":
            assert e.batch is not None
            if running:
                target = e.seq, next(iter(running))
                break
            for g in (*e.batch.group_ids, *e.batch.dropped):
                running.pop(g, None)
    assert target is not None
    seq, stranger = target

    def swap(e: dict[str, object]) -> bool:
        if e["seq"] == seq:
            batch = e["batch"]
            assert isinstance(batch, dict)
            batch["group_ids"][0] = stranger
            return True
        return False

    bad = tmp_path / "fifo.jsonl"
    index, _ = _rewrite(good_trace, bad, swap)
    done = _check(bad)
    assert done.returncode == 1
    assert f"event #{index} (line {index + 2}, seq {seq}, consume(buffer" in done.stdout


def test_checker_rejects_a_lost_event_and_an_unreadable_file(good_trace: Path, tmp_path: Path) -> None:
    lines = good_trace.read_text().splitlines()
    del lines[10]  # event #9 never reached the trace (e.g. an unlocked concurrent writer)
    bad = tmp_path / "lost.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    done = _check(bad)
    # format /2 logs before-states only where the chain breaks: the lost event's effect is missing
    # from the spec's state, so the next event's logged after-state differs from it
    assert done.returncode == 1 and "event #9 (line 11," in done.stdout and "after-state" in done.stdout
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"type": "event"}\n')
    unreadable = _check(junk, good_trace)
    assert unreadable.returncode == 2 and "the first line of a trace must be its header" in unreadable.stderr
    assert "accepted" in unreadable.stdout  # the good file after it is still checked


def _active_before(events: list[ProtocolEvent], index: int) -> set[object]:
    """The groups active (reserved, not yet aborted, consumed or dropped) before event ``index``."""
    active: set[object] = set()
    for e in events[:index]:
        if e.op == "reserve" and e.accepted:
            active.add(e.group_id)
        elif e.op == "abort":
            active.discard(e.group_id)
        elif e.op == "consume" and e.batch is not None:
            active -= {*e.batch.group_ids, *e.batch.dropped}
    return active


def _first(events: list[ProtocolEvent], test: object) -> int:
    return next(i for i, e in enumerate(events) if test(e))  # type: ignore[operator]


def _edit(events: list[ProtocolEvent], test: object, **changes: object) -> int:
    index = _first(events, test)
    events[index] = dataclasses.replace(events[index], **changes)
    return index


def _edit_batch(events: list[ProtocolEvent], test: object, change: object) -> int:
    index = _first(events, lambda e: e.op == "consume" and test(e.batch))  # type: ignore[operator]
    batch = events[index].batch
    events[index] = dataclasses.replace(events[index], batch=dataclasses.replace(batch, **change(batch)))  # type: ignore[operator]
    return index


def _refuse_an_active_group(events: list[ProtocolEvent]) -> int:
    index = _first(events, lambda e: e.op == "reserve" and e.accepted is False and _active_before(events, events.index(e)))
    events[index] = dataclasses.replace(events[index], group_id=sorted(map(str, _active_before(events, index)))[0])
    return index


#: A real trace's events, each edited into a step the spec does not allow, and what the replay says.
TAMPERED = {
    "refused reserve of an active group": (_refuse_an_active_group, "which is active"),
    "enabled reserve logged as refused": (
        lambda ev: _edit(ev, lambda e: e.op == "reserve" and e.accepted, accepted=False, after=ev[0].before),
        "refused but Reserve is enabled"),
    "occupy of an unknown group": (lambda ev: _edit(ev, lambda e: e.op == "occupy", group_id="nobody"),
                                   "occupy('nobody') is not enabled in the spec"),
    "consume of another buffer": (lambda ev: _edit_batch(ev, lambda b: True, lambda b: {"version": b.version + 1}),
                                  "consume of buffer 1, but the spec's head is 0"),
    "a group trained twice": (lambda ev: _edit_batch(ev, lambda b: len(b.group_ids) > 1,
                                                     lambda b: {"group_ids": (b.group_ids[0], *b.group_ids[:-1])}),
                              "not distinct active groups"),
    "wrong group versions": (
        lambda ev: _edit_batch(ev, lambda b: True, lambda b: {"group_versions": tuple(v + 1 for v in b.group_versions)}),
        "consume logs versions"),
    "drops left out": (lambda ev: _edit_batch(ev, lambda b: b.dropped, lambda b: {"dropped": ()}), "consume drops [], the spec drops"),
    "wrong after-state": (lambda ev: _edit(ev, lambda e: e.op == "occupy", after=ev[0].before), "after-state"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_replay_names_each_kind_of_step_the_spec_does_not_allow(good_trace: Path, case: str) -> None:
    tamper, reason = TAMPERED[case]
    segment = read_trace(good_trace)[0]
    events = list(segment.events)
    assert replay_events(segment.header, events) is None  # the real trace is accepted
    index = tamper(events)
    rejection = replay_events(segment.header, events)
    assert rejection is not None and rejection.index == index and reason in rejection.reason, rejection


@pytest.mark.parametrize(("start", "message"), [
    ({"eta": 3}, "trace header and its start snapshot disagree on eta"),
    ({"version": -1}, "start snapshot needs an int version >= 0 and a list of groups"),
    ({"groups": [["x", 0, "paused"]]}, "start snapshot: invalid group entry \\['x', 0, 'paused'\\]"),
    ({"groups": [["x", 0, "running"], ["x", 0, "done"]]}, "start snapshot: a group appears twice or is ahead of the trainer"),
], ids=["other eta", "negative version", "unknown status", "a group twice"])
def test_a_resumed_segments_start_snapshot_is_checked(good_trace: Path, start: dict[str, object], message: str) -> None:
    segment = read_trace(good_trace)[1]  # the resumed run's: it starts from a snapshot
    assert segment.header.start is not None and replay_events(segment.header, segment.events) is None
    header = dataclasses.replace(segment.header, start={**segment.header.start, **start})
    with pytest.raises(TraceFormatError, match=message):
        replay_events(header, segment.events)


def test_checker_rejects_a_start_snapshot_that_breaks_the_invariant(tmp_path: Path) -> None:
    manager = StalenessManager(eta=0, batch_size=1)
    path = tmp_path / "start.jsonl"
    with protocol.trace.JsonlTraceWriter.attach(manager, path):
        manager.reserve("a", 0)
    header = json.loads(path.read_text().splitlines()[0])
    header["start"]["groups"] = [["x", 0, "running"], ["y", 0, "running"]]  # 2 groups due, capacity 1
    path.write_text(json.dumps(header) + "\n")
    done = _check(path)
    assert done.returncode == 2 and "violates Inv (cap0)" in done.stderr


# ----------------------------------------------------------------------------- thread safety


def test_locked_manager_keeps_invariant_and_accounting_under_threads(tmp_path: Path) -> None:
    """4 producer threads reserve/occupy/abort while a trainer thread consumes, with a tiny switch
    interval; every event sees the invariant, no event is lost (seq is contiguous), every accepted
    group ends consumed, aborted, dropped or active exactly once, every batch keeps the bound, and
    the trace of the interleaving is a behaviour of the spec."""
    eta, batch_size, redundancy = 2, 4, 1
    locked = LockedStalenessManager.create(eta, batch_size, redundancy)
    seqs: list[int] = []
    broken: list[str] = []

    def invariant_hook(event: ProtocolEvent) -> None:
        seqs.append(event.seq)
        prefix = 0
        for k in range(eta + 1):
            prefix += event.after.running[k] + event.after.done[k]
            if prefix > (k + 1) * batch_size + redundancy:
                broken.append(f"seq {event.seq}: Inv broken at offset {k}")

    locked.add_event_hook(invariant_hook)
    trace = tmp_path / "threads.jsonl"
    writer = locked.attach_trace(trace, refusals=True)
    accepted: list[set[str]] = [set() for _ in range(4)]
    aborted: list[set[str]] = [set() for _ in range(4)]
    batches: list[protocol.ConsumedBatch] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer(k: int) -> None:
        rng = random.Random(k)
        mine: list[str] = []

        def finish() -> None:
            finished = mine.pop(rng.randrange(len(mine)))
            if rng.random() < 0.1:
                if locked.abort_if_active(finished):
                    aborted[k].add(finished)
            else:
                try:
                    locked.occupy(finished)
                except protocol.UnknownGroupError:  # dropped by the trainer in between (X > 0)
                    pass

        try:
            n = 0
            # until the trainer has consumed enough batches (a fixed count of reserves could all be
            # refused while a loaded machine starves the trainer thread), or a generous deadline
            while len(batches) < 60 and time.monotonic() < deadline:
                n += 1
                group_id = f"t{k}-{n}"
                admitted = locked.reserve(group_id, max(0, locked.version - rng.randint(0, eta)))
                if admitted:
                    accepted[k].add(group_id)
                    mine.append(group_id)
                if mine and (not admitted or rng.random() < 0.7):
                    finish()
            while mine:
                finish()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    def trainer() -> None:
        try:
            while not stop.is_set():
                batch = locked.try_consume()
                if batch is not None:
                    batches.append(batch)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    deadline = time.monotonic() + 120
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
        consumer = threading.Thread(target=trainer)
        consumer.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        consumer.join()
    finally:
        sys.setswitchinterval(switch)
        writer.close()
    assert not errors, errors
    assert not broken, broken[:3]
    assert seqs == list(range(len(seqs)))
    assert len(batches) >= 60 and [b.version for b in batches] == list(range(len(batches)))
    all_accepted = set().union(*accepted)
    consumed = [g for b in batches for g in b.group_ids]
    dropped = [g for b in batches for g in b.dropped]
    active = {g.group_id for g in locked.groups()}
    removed = set().union(*aborted)
    assert all(len(b.group_ids) == batch_size and len(b.dropped) <= redundancy for b in batches)
    assert len(consumed) + len(dropped) == len(set(consumed) | set(dropped))  # nothing twice
    assert set(consumed) | set(dropped) | removed | active == all_accepted
    assert len(consumed) + len(dropped) + len(removed) + len(active) == len(all_accepted)
    assert all(v <= b.version <= v + eta for b in batches for v in b.group_versions)
    report = check.check_trace(trace)
    assert report.accepted, (report.offending, report.reason)
    assert report.events == len(seqs)


def test_bench_lock_cost_replays_the_same_calls_on_both_managers() -> None:
    from staleflow.bench.protocol import lock_cost
    from staleflow.bench.trace_cost import recorded_ops

    ops = recorded_ops(eta=1, batch_size=8, batches=10, seed=0)
    plain, locked = StalenessManager(1, 8), LockedStalenessManager.create(1, 8)
    results = [[getattr(m, op)(*args) for op, args in ops] for m in (plain, locked)]
    assert results[0] == results[1] and plain.snapshot() == locked.snapshot()
    assert plain.version == 10 and any(r is False for r in results[0])  # refused reserves replayed too
    rows = lock_cost(batches=5, seed=0, overhead_ns=0.0, repeats=1)
    assert set(rows) == {"eta=1,B=64", "eta=3,B=512"}
    assert all(r["plain_ns_per_op"] > 0 and r["locked_ns_per_op"] > 0 for r in rows.values())
