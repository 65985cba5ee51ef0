"""Implementation mutants: small bugs planted in ``protocol/manager.py`` that the checks must catch.

Each mutant is a one-place source edit of the real ``manager.py`` (read from disk, never written),
compiled into a fresh module; its ``StalenessManager`` is then run through the dynamic layers,
cheapest first: the exhaustive small-scope conformance check, the Hypothesis conformance machine
(both against the spec mirror), and trace validation of traces the mutant wrote. A mutant that no
layer catches is a failure: the
layers would miss that bug. If ``manager.py`` changes so that a mutant's original text no longer
occurs exactly once, that mutant fails too, naming the text to update.
"""

from __future__ import annotations

import importlib
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from staleflow.protocol import StalenessManager
from staleflow.protocol import manager as manager_module
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.conformance import run_conformance
from staleflow.verification.proofs.conformance_grid import exhaustive_conformance


@dataclass(frozen=True)
class Mutant:
    name: str
    operation: str
    bug: str
    original: str
    replacement: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "reserve-checks-own-offset-only",
        "reserve",
        "admission checks only the prefix at the group's own deadline, not the later ones",
        "if k >= offset and capacity - prefix < slack:",
        "if k == offset and capacity - prefix < slack:",
    ),
    Mutant(
        "reserve-admits-at-zero-slack",
        "reserve",
        "admits a group when the slack is 0",
        "accepted = self._slack_at(offset) > 0",
        "accepted = self._slack_at(offset) >= 0",
    ),
    Mutant(
        "reserve-past-deadline",
        "reserve",
        "a group whose deadline was the previous buffer is not refused",
        "if offset < 0:\n            return 0",
        "if offset < -1:\n            return 0",
    ),
    Mutant(
        "reserve-slack-off-by-one",
        "reserve_slack",
        "reserve_slack/can_reserve look at the next deadline offset",
        "return self._slack_at(version + self._eta - self._version)\n",
        "return self._slack_at(version + self._eta - self._version + 1)\n",
    ),
    Mutant(
        "oldest-admissible-skips-oldest",
        "oldest_admissible_version",
        "never answers the oldest still-valid version",
        "range(max(0, self._version - self._eta), self._version + 1)",
        "range(max(0, self._version - self._eta + 1), self._version + 1)",
    ),
    Mutant(
        "reserve-refusal-not-emitted",
        "reserve (events)",
        "a refused reserve emits no event",
        'if self._hooks:\n            self._emit("reserve"',
        'if self._hooks and accepted:\n            self._emit("reserve"',
    ),
    Mutant(
        "occupy-skips-status-check",
        "occupy",
        "occupy of a done group is not refused with InvalidTransitionError",
        "if group_id not in bucket.running:\n            raise InvalidTransitionError",
        "if False:\n            raise InvalidTransitionError",
    ),
    Mutant(
        "occupy-keeps-running-copy",
        "occupy",
        "the group is marked done but stays in the running set",
        "del bucket.running[group_id]\n        bucket.done[group_id] = None",
        "bucket.done[group_id] = None",
    ),
    Mutant(
        "abort-leaves-done-group",
        "abort",
        "aborting a done group leaves it in its bucket",
        "if bucket.running.pop(group_id, bucket) is bucket:\n            del bucket.done[group_id]\n"
        "            offset += self._eta + 1",
        "bucket.running.pop(group_id, None)",
    ),
    Mutant(
        "abort-keeps-index",
        "abort",
        "an aborted group stays known to the manager",
        'del self._versions[group_id]\n        if self._hooks:\n            self._emit("abort"',
        'if self._hooks:\n            self._emit("abort"',
    ),
    Mutant(
        "occupy-keeps-running-count",
        "occupy",
        "the group moves to the done set but the counts still say it runs",
        "counts[offset] -= 1\n        counts[offset + self._eta + 1] += 1",
        "counts[offset + self._eta + 1] += 1",
    ),
    Mutant(
        "consume-waits-for-all-running",
        "can_consume",
        "consume is not eager: it waits until no group is running",
        "if need:\n            return None",
        "if need or any(b.running for b in self._buckets):\n            return None",
    ),
    Mutant(
        "consume-drops-one-too-many",
        "consume",
        "consume may drop redundancy + 1 head groups",
        "if counts[0] + counts[offsets] - plan[0] > self._redundancy:",
        "if counts[0] + counts[offsets] - plan[0] > self._redundancy + 1:",
    ),
    Mutant(
        "consume-prefix-capacity-off-by-one",
        "consume",
        "consume checks the remaining groups against cap(k) instead of cap(k - 1)",
        "if prefix > self.capacity(k - 1):",
        "if prefix > self.capacity(k):",
    ),
    Mutant(
        "consume-takes-from-wrong-buckets",
        "consume",
        "the batch is taken from the latest deadlines instead of the planned ones",
        "for bucket, count in zip(self._buckets, plan):",
        "for bucket, count in zip(reversed(self._buckets), plan):",
    ),
    Mutant(
        "consume-forgets-running-drops",
        "consume",
        "running head groups are discarded without being reported as dropped",
        "dropped = (*head.running, *head.done)",
        "dropped = tuple(head.done)",
    ),
    Mutant(
        "consume-prefix-not-cumulative",
        "consume",
        "the guard checks each later offset alone, not the prefix of remaining groups (shows at eta >= 3)",
        "prefix += counts[k] + counts[offsets + k] - plan[k]",
        "prefix = counts[k] + counts[offsets + k] - plan[k]",
    ),
    Mutant(
        "consume-guard-next-buffer-only",
        "consume",
        "the guard checks the remaining groups only against the next buffer (shows at eta >= 3)",
        "for k in range(1, offsets):",
        "for k in range(1, min(offsets - 1, 1) + 1):",
    ),
    Mutant(
        "restore-skips-invariant",
        "restore",
        "restore does not check Inv (a snapshot with too many groups due is accepted)",
        "        manager._check_invariant()\n",
        "",
    ),
    Mutant(
        "restore-wraps-past-deadline",
        "restore",
        "a group one buffer past its deadline wraps into the newest bucket (negative index)",
        "if not 0 <= offset <= self._eta:",
        "if offset < -1:",
    ),
    Mutant(
        "buffers-index-off-by-one",
        "buffers",
        "buffer views are numbered from the trainer's next version, not the head buffer",
        "BufferView(self._version + i, self.capacity(0)",
        "BufferView(self._version + i + 1, self.capacity(0)",
    ),
    Mutant(
        "buffers-redundancy-in-every-buffer",
        "buffers",
        "every buffer view holds B + X groups, not only the head",
        "self.capacity(0) if i == 0 else self._batch_size, 0, 0)",
        "self.capacity(0), 0, 0)",
    ),
    Mutant(
        "snapshot-loses-status",
        "snapshot",
        "a snapshot records every group as running",
        "[g.group_id, g.version, g.status.value]",
        '[g.group_id, g.version, "running"]',
    ),
)


class MutationError(Exception):
    """A mutant's original text does not occur exactly once in manager.py."""


def mutant_class(mutant: Mutant | None) -> type[StalenessManager]:
    """Compile manager.py with the mutant's edit (None: unmodified) into a fresh module; return
    its manager class."""
    source = Path(manager_module.__file__).read_text(encoding="utf-8")
    name = "baseline" if mutant is None else mutant.name
    if mutant is not None:
        count = source.count(mutant.original)
        if count != 1:
            raise MutationError(
                f"mutant {name}: {mutant.original!r} occurs {count} times in protocol/manager.py"
            )
        source = source.replace(mutant.original, mutant.replacement)
    return compile_manager(source, name)


def compile_manager(source: str, name: str) -> type[StalenessManager]:
    """Compile a (mutated) text of manager.py into a fresh module; return its manager class."""
    module = types.ModuleType(f"staleflow.protocol._mutant_{name.replace('-', '_')}")
    module.__file__ = f"<mutant {name} of {manager_module.__file__}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own file
    cls: type[StalenessManager] = module.StalenessManager
    return cls


# --------------------------------------------------------------------------- layers
#: A layer runs a manager class through one kind of check; it returns why it caught the class
#: (a failure message) or None if the class passed.
Layer = Callable[[type[StalenessManager]], "str | None"]


#: Grids of the mutant rows: smaller than the verify rows' (every mutant, and the baseline, runs
#: through them), eta 3 first so that the eta >= 3 consume bugs are found at once. ``bench
#: mutation`` judges with the verify --quick rows' own grids instead (:func:`make_layers`).
MUTANT_EXHAUSTIVE_GRID: tuple[tuple[int, int, int], ...] = (
    (3, 1, 0), *((eta, b, x) for eta in range(3) for b in (1, 2) for x in range(2)))
MUTANT_MODEL_GRID = MUTANT_EXHAUSTIVE_GRID
MUTANT_RESTORE_COUNT = 1_500


def _catch(check: Callable[[], object]) -> str | None:
    try:
        check()
    except Exception as error:  # noqa: BLE001 - any failure of the checked code is a caught failure
        return _first_line(error)
    return None


def make_layers(
    exhaustive_grid: Sequence[tuple[int, int, int]],
    model_grid: Sequence[tuple[int, int, int]],
    restore_count: int,
) -> dict[str, Layer]:
    """The dynamic layers, cheapest first, at the given bounds."""
    from staleflow.verification.proofs.model_link import compare_grid
    from staleflow.verification.proofs.snapshots import fuzz_restore

    return {
        "restore": lambda cls: _catch(lambda: fuzz_restore(cls, restore_count)),
        "exhaustive": lambda cls: _catch(lambda: exhaustive_conformance(cls, exhaustive_grid)),
        "model": lambda cls: _catch(lambda: compare_grid(cls, model_grid)),
        "conformance": conformance_layer,
        "trace validation": trace_layer,
    }


def conformance_layer(manager_cls: type[StalenessManager]) -> str | None:
    try:
        run_conformance(manager_cls, profile="mutant")
    except Exception as error:  # noqa: BLE001 - any failure of the checked code is a caught failure
        return _first_line(error)
    return None


def trace_layer(manager_cls: type[StalenessManager]) -> str | None:
    """Record the trace-validation workloads on ``manager_cls`` and replay them on the mirror."""
    validation = importlib.import_module("staleflow.verification.proofs.trace_validation")
    for eta, batch_size, redundancy, ops, seed, resume_at in validation.WORKLOADS_FULL:
        with tempfile.TemporaryDirectory(prefix="staleflow-mutant-") as folder:
            path = Path(folder) / "trace.jsonl"
            # record_workload_trace drives the real manager class; point it at the mutant.
            with mock.patch.object(validation, "StalenessManager", manager_cls):
                try:
                    validation.record_workload_trace(path, eta, batch_size, redundancy, ops, seed, resume_at)
                except Exception as error:  # noqa: BLE001 - any failure of the checked code is a caught failure
                    return f"the workload failed while recording: {_first_line(error)}"
            verdict = validation.validate_trace(path, use_tlc=False)
        if not verdict.ok:
            return f"eta={eta} B={batch_size} X={redundancy}: {verdict.detail}"
    return None


#: Every dynamic layer a mutant row is run through, cheapest first.
LAYERS: dict[str, Layer] = {}


# --------------------------------------------------------------------------- the check
def check_mutant(mutant: Mutant, every_layer: bool) -> tuple[CheckResult, list[str]]:
    """Run a mutant through the layers (all of them, or until one catches it); returns its row
    and the layers that caught it."""
    started = time.perf_counter()
    caught_by: dict[str, str] = {}
    try:
        cls = mutant_class(mutant)
        for name, layer in LAYERS.items():
            why = layer(cls)
            if why is not None:
                caught_by[name] = why
                if not every_layer:
                    break
        result = "pass" if caught_by else "fail"
        explored = "caught by " + ", ".join(caught_by) if caught_by else "survived every layer"
        detail = "; ".join(f"{name}: {why}" for name, why in caught_by.items())
    except MutationError as error:
        result, explored, detail = "fail", "mutation does not apply", str(error)
    row = CheckResult(
        name=f"mutant {mutant.name}",
        property=f"{mutant.operation}: {mutant.bug} is caught",
        method="source mutation of protocol/manager.py; layers "
        + (" + ".join(LAYERS) if every_layer else " then ".join(LAYERS) + " until caught"),
        bounds=BOUNDS,
        explored=explored,
        result=result,
        seconds=round(time.perf_counter() - started, 3),
        detail=detail[:500],
    )
    return row, list(caught_by)


BOUNDS = (
    "restore-fuzz 1,500 snapshots; every Inv state of eta 0..2 x B 1..2 x X 0..1 and (3, 1, 0) at every head "
    "(exhaustive and model); Hypothesis profile 'mutant' (200 x 50, no shrinking); 3 traced workloads"
)


def check_baseline(layers: list[str]) -> CheckResult:
    """The unmutated source, compiled the same way, must pass each layer that caught a mutant;
    else that catch would prove nothing."""
    started = time.perf_counter()
    cls = mutant_class(None)
    rejected = {name: why for name in layers if (why := LAYERS[name](cls)) is not None}
    return CheckResult(
        name="mutant baseline",
        property="the unmutated manager.py, compiled as the mutants are, passes the layers",
        method=" + ".join(layers),
        bounds=BOUNDS,
        explored="rejected by " + ", ".join(rejected) if rejected else f"passed {len(layers)} layers",
        result="fail" if rejected else "pass",
        seconds=round(time.perf_counter() - started, 3),
        detail="; ".join(f"{name}: {why}" for name, why in rejected.items()),
    )


def checks(quick: bool) -> list[CheckResult]:
    """One row per mutant, after a baseline row. The quick run stops at the first layer that
    catches a mutant and checks the baseline on the layers that caught one; the full run reports
    every layer that catches each mutant and checks the baseline on every layer."""
    outcomes = [check_mutant(mutant, every_layer=not quick) for mutant in MUTANTS]
    catching = {name for _, caught_by in outcomes for name in caught_by}
    used = [name for name in LAYERS if not quick or name in catching]
    return [check_baseline(used), *(row for row, _ in outcomes)]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


LAYERS.update(make_layers(MUTANT_EXHAUSTIVE_GRID, MUTANT_MODEL_GRID, MUTANT_RESTORE_COUNT))
