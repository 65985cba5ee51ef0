"""Parameter server: versions, eviction, copies, and readers never seeing a half-written version."""

from __future__ import annotations

import threading

import pytest
from staleflow.runtime.servers.parameter_server import (
    ParameterServer,
    ReadWriteLock,
    VersionNotAvailableError,
)


def test_push_pull_latest_and_keep():
    ps = ParameterServer(keep=2)
    assert ps.latest_version() is None
    with pytest.raises(VersionNotAvailableError):
        ps.pull()
    for v in range(4):
        ps.push(v, {"w": v})
    assert ps.latest_version() == 3 and ps.versions() == (2, 3)
    assert ps.pull() == (3, {"w": 3})
    assert ps.pull(2) == (2, {"w": 2})
    with pytest.raises(VersionNotAvailableError, match="version 1 is not on the parameter server"):
        ps.pull(1)
    with pytest.raises(ValueError, match="version 3 is already stored"):
        ps.push(3, {})


def test_pushed_weights_are_copied():
    ps = ParameterServer()
    weights = {"w": [1, 2]}
    ps.push(0, weights)
    weights["w"].append(3)  # the trainer goes on changing its own weights
    assert ps.pull(0)[1] == {"w": [1, 2]}


def test_reader_sees_previous_version_until_push_completes():
    started, release = threading.Event(), threading.Event()

    def slow_copy(weights):
        started.set()
        assert release.wait(10)
        return dict(weights)

    ps = ParameterServer(copy_weights=slow_copy)
    release.set()
    ps.push(0, {"v": 0})
    release.clear()
    started.clear()
    pusher = threading.Thread(target=ps.push, args=(1, {"v": 1}))
    pusher.start()
    assert started.wait(10)
    assert ps.pull() == (0, {"v": 0})  # version 1 is being written: not visible yet
    release.set()
    pusher.join(10)
    assert ps.pull() == (1, {"v": 1})


def test_rw_lock_writer_excludes_readers_and_waits_for_them():
    lock = ReadWriteLock()
    log: list[str] = []
    reader_in, writer_done = threading.Event(), threading.Event()
    release_reader = threading.Event()

    def reader():  # no assert here: a failure in a thread would not fail the test; the log shows it
        with lock.reading():
            log.append("read-start")
            reader_in.set()
            log.append("read-end" if release_reader.wait(10) else "reader never released")

    def writer():
        with lock.writing():
            log.append("write")
        writer_done.set()

    r = threading.Thread(target=reader)
    r.start()
    assert reader_in.wait(10)
    w = threading.Thread(target=writer)
    w.start()
    assert not writer_done.wait(0.05)  # the writer waits while a reader holds the lock
    release_reader.set()
    assert writer_done.wait(10)
    r.join(10)
    w.join(10)
    assert log == ["read-start", "read-end", "write"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        ParameterServer(keep=0)
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        ParameterServer().push(-1, {})


def test_a_remote_reference_fetches_its_version_and_names_a_lost_or_wrong_answer():
    """What a rollout instance's engine does with a pulled reference (in its own Ray actor; here the
    parameter server object stands in for its actor proxy, which forwards the same calls)."""
    from staleflow.adapters.ray.parameter_server import RemoteParameterServer, RemoteWeights
    from staleflow.runtime.interfaces import TransferFailedError

    server = ParameterServer(keep=2)
    server.push(4, {"w": [1.0]})
    remote = RemoteParameterServer(server)
    version, reference = remote.pull()
    assert (version, reference.version, repr(reference)) == (4, 4, "RemoteWeights(version=4)")
    assert reference.fetch() == {"w": [1.0]} and remote.state_dict() == server.state_dict()
    with pytest.raises(VersionNotAvailableError, match="version 3 is not on the parameter server \\(it holds \\[4\\]\\)"):
        remote.pull(3)

    class Answers:  # a server answering with another version, then one whose actor is gone
        def __init__(self, answer):
            self.answer = answer

        def pull(self, version):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    with pytest.raises(VersionNotAvailableError, match="asked for version 4, the parameter server sent 5"):
        RemoteWeights(Answers((5, {})), 4).fetch()
    with pytest.raises(TransferFailedError, match="pull of version 4: actor died"):
        RemoteWeights(Answers(ConnectionError("actor died")), 4).fetch()
