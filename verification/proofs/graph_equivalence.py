"""The TLA+ spec and its Python mirror have the same state graph (checked exhaustively at small bounds).

TLC dumps the full state graph of a model (``-dump dot,actionlabels``); a breadth-first search of
``spec/mirror.py`` over the same constants builds the mirror's graph. Every TLC state is mapped to
a mirror state (head ``c`` and the set of active ``(group, version, status)``; the ghost ``batch``
is dropped) and must be reachable in the mirror, every mirror state must appear in TLC's graph,
and the successors of every TLC state must be exactly the mirror's successors of its image.

Two models are compared: the absolute spec (``MCStalenessBuffer``, head bounded by ``MaxVersion``)
and the relative lag model used for liveness (``MCLag``), whose states are the mirror's states
normalised by :func:`normalise` (head capped at ``eta``, versions shifted). Passing both shows the
lag model is the absolute spec seen relative to the head, at those bounds.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staleflow.spec import mirror
from staleflow.spec.mirror import MirrorState, SpecParams
from staleflow.verification.checks import CheckResult
from staleflow.verification.proofs.tlc import TlcUnavailableError, cfg_text, run_tlc

# ----------------------------------------------------------------------------- TLA+ values


class _ValueParser:
    """Parses the TLA+ values TLC prints: ints, strings, model values, sets, tuples, records, functions."""

    _TOKEN = re.compile(r'\s*(-?\d+|"(?:[^"\\]|\\.)*"|<<|>>|\|->|:>|@@|[A-Za-z_][A-Za-z0-9_]*|[{}\[\](),])')

    def __init__(self, text: str) -> None:
        self.tokens: list[str] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            match = self._TOKEN.match(text, pos)
            if match is None:
                raise ValueError(f"cannot parse TLA+ value at {text[pos:pos + 30]!r}")
            self.tokens.append(match.group(1))
            pos = match.end()
            while pos < len(text) and text[pos].isspace():
                pos += 1
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i] if self.i < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r}")
        self.i += 1
        return token

    def items(self, closer: str) -> list[Any]:
        out = []
        while self.peek() != closer:
            out.append(self.value())
            if self.peek() == ",":
                self.take(",")
        self.take(closer)
        return out

    def value(self) -> Any:
        token = self.take()
        if token == "{":
            return frozenset(self.items("}"))
        if token == "<<":
            return tuple(self.items(">>"))
        if token == "[":
            record = {}
            while self.peek() != "]":
                key = self.take()
                self.take("|->")
                record[key] = self.value()
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return record
        if token == "(":
            function = {}
            while self.peek() != ")":
                key = self.value()
                self.take(":>")
                function[key] = self.value()
                if self.peek() == "@@":
                    self.take("@@")
            self.take(")")
            return function
        if token.startswith('"'):
            return token[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        if token in ("TRUE", "FALSE"):
            return token == "TRUE"
        return token  # a model value


def parse_tla_value(text: str) -> Any:
    parser = _ValueParser(text)
    value = parser.value()
    if parser.peek():
        raise ValueError(f"trailing text after TLA+ value: {parser.tokens[parser.i:]!r}")
    return value


def parse_state(label: str) -> dict[str, Any]:
    """A TLC state printed as ``/\\ var = value`` conjuncts."""
    state = {}
    for conjunct in label.split("/\\ ")[1:]:
        name, _, value = conjunct.partition(" = ")
        state[name.strip()] = parse_tla_value(value)
    return state


_NODE = re.compile(r'^(-?\d+) \[label="((?:[^"\\]|\\.)*)"', re.MULTILINE)
_EDGE = re.compile(r"^(-?\d+) -> (-?\d+)", re.MULTILINE)


def parse_dot(text: str) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
    """Nodes (id -> variables) and edges of a TLC ``-dump dot`` file."""
    nodes = {}
    for node_id, label in _NODE.findall(text):
        unescaped = label.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        nodes[node_id] = parse_state(unescaped)
    return nodes, _EDGE.findall(text)


def to_mirror(variables: Mapping[str, Any]) -> MirrorState:
    """The mirror state of a TLC state: the head and the active groups (ghost ``batch`` dropped)."""
    st, ver = variables["st"], variables["ver"]
    return MirrorState(
        variables["c"],
        frozenset((g, ver[g], st[g]) for g in st if st[g] != "idle"),
    )


# ----------------------------------------------------------------------------- mirror graph


def normalise(p: SpecParams, s: MirrorState) -> MirrorState:
    """The lag model's view of a state: head capped at ``eta``, versions shifted with it."""
    shift = max(0, s.version - p.eta)
    if shift == 0:
        return s
    return MirrorState(s.version - shift, frozenset((g, v - shift, st) for g, v, st in s.groups))


def successors(p: SpecParams, s: MirrorState, groups: tuple[str, ...]) -> set[MirrorState]:
    """Every successor of ``s`` in the mirror: Reserve(g, v), Occupy(g), Abort(g), Consume."""
    out: set[MirrorState] = set()
    for g in groups:
        for v in range(s.version + 1):
            t = mirror.reserve(p, s, g, v)
            if t is not None:
                out.add(t)
        for action in (mirror.occupy, mirror.abort):
            t = action(p, s, g)
            if t is not None:
                out.add(t)
    out.update(step.state for step in mirror.consume(p, s))
    return out


def mirror_graph(
    p: SpecParams, groups: tuple[str, ...], keep: Callable[[MirrorState], bool],
    view: Callable[[MirrorState], MirrorState],
) -> dict[MirrorState, set[MirrorState]]:
    """Breadth-first search of the mirror from ``init``, states seen through ``view``, kept if ``keep``."""
    start = view(mirror.init())
    graph: dict[MirrorState, set[MirrorState]] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        s = queue.popleft()
        nexts = {view(t) for t in successors(p, s, groups)}
        graph[s] = {t for t in nexts if keep(t)}
        for t in graph[s] - seen:
            seen.add(t)
            queue.append(t)
    return graph


# ----------------------------------------------------------------------------- comparison


@dataclass
class GraphComparison:
    tlc_states: int = 0
    tlc_edges: int = 0
    mirror_states: int = 0
    mirror_edges: int = 0
    mismatches: list[str] = field(default_factory=list)
    tlc_outcome: str = ""
    #: refusal reasons seen alone (``spec.mirror.sole_refusal_reasons``) over the mirror's states
    refusals: set[str] = field(default_factory=set)

    @property
    def equal(self) -> bool:
        return not self.mismatches and self.tlc_states > 0 and self.tlc_outcome == "ok"


def compare_graphs(
    params: SpecParams,
    n_groups: int,
    max_version: int | None,
    overrides: Mapping[str, str] | None = None,
    max_reported: int = 5,
) -> GraphComparison:
    """Compare TLC's graph of the absolute model (``max_version`` given) or of the lag model (None)
    with the mirror's graph over the same constants. ``overrides`` may replace spec files (mutants)."""
    groups = tuple(f"g{i}" for i in range(1, n_groups + 1))
    constants: dict[str, int | tuple[str, ...]] = {"Eta": params.eta, "B": params.batch_size, "X": params.redundancy}

    def keep(state: MirrorState) -> bool:
        return max_version is None or state.version <= max_version

    if max_version is None:
        module, spec, view = "MCLag", "LagSpec", (lambda s: normalise(params, s))
        cfg = cfg_text({**constants, "Groups": groups}, spec)
    else:
        module, spec, view = "MCStalenessBuffer", "Spec", (lambda s: s)
        cfg = cfg_text({**constants, "MaxVersion": max_version, "Groups": groups}, spec, constraint="VersionBound")
    result = GraphComparison()
    with tempfile.TemporaryDirectory(prefix="staleflow-graph-") as tmp:
        dot = Path(tmp) / "graph.dot"
        run = run_tlc(module, cfg, overrides=overrides, dump_dot=dot)
        result.tlc_outcome = run.outcome
        if not run.ok:
            result.mismatches.append(f"TLC did not complete: rc {run.returncode} ({run.outcome}) {run.violated}")
            return result
        nodes, edges = parse_dot(dot.read_text())
    tlc_succ: dict[str, set[MirrorState]] = {node: set() for node in nodes}
    for src, dst in edges:
        tlc_succ[src].add(to_mirror(nodes[dst]))
    reference = mirror_graph(params, groups, keep, view)
    for state in reference:
        result.refusals |= mirror.sole_refusal_reasons(params, state, idle_group=len(state.groups) < len(groups))
    result.tlc_states, result.tlc_edges = len(nodes), len(edges)
    result.mirror_states = len(reference)
    result.mirror_edges = sum(len(v) for v in reference.values())
    images = {node: to_mirror(variables) for node, variables in nodes.items()}
    mismatches = result.mismatches
    for state in set(images.values()) - reference.keys():
        mismatches.append(f"state in TLC only: {_show(state)}")
    for state in reference.keys() - set(images.values()):
        mismatches.append(f"state in mirror only: {_show(state)}")
    for node, image in images.items():
        if image not in reference:
            continue
        extra, missing = tlc_succ[node] - reference[image], reference[image] - tlc_succ[node]
        if extra or missing:
            mismatches.append(
                f"successors of {_show(image)}: TLC only {[_show(t) for t in extra][:3]}, "
                f"mirror only {[_show(t) for t in missing][:3]}")
    if len(mismatches) > max_reported:
        result.mismatches = mismatches[:max_reported] + [f"... {len(mismatches) - max_reported} more"]
    return result


def _show(s: MirrorState) -> str:
    groups = ", ".join(f"{g}:v{v}:{st}" for g, v, st in sorted(s.groups))
    return f"c={s.version} {{{groups}}}"


#: (name, params, groups, max_version or None for the lag model) per mode. The quick models are the
#: constants of safety_quick.cfg and liveness.cfg; the full ones add a model with redundancy and
#: those of liveness_x0.cfg. Each has more groups than the first two buffers hold
#: (2B + X), so a later buffer's constraint binds.
MODELS_QUICK = [
    ("absolute", SpecParams(eta=2, batch_size=1, redundancy=0), 4, 3),
    ("lag", SpecParams(eta=2, batch_size=1, redundancy=1), 4, None),
]
MODELS_FULL = [
    ("absolute", SpecParams(eta=2, batch_size=1, redundancy=0), 4, 3),
    ("absolute-x1", SpecParams(eta=2, batch_size=1, redundancy=1), 4, 3),
    ("lag", SpecParams(eta=2, batch_size=1, redundancy=1), 4, None),
    ("lag-x0", SpecParams(eta=2, batch_size=1, redundancy=0), 4, None),
]


def expected_refusals(p: SpecParams, n_groups: int, absolute: bool) -> list[str]:
    """The refusal reasons coverage requires at these bounds: every one that can bind (a capacity
    conjunct needs more groups than it allows; the lag model has no group past its deadline)."""
    out = []
    for reason in mirror.refusal_reasons(p):
        if reason == "reserve:deadline" and not absolute:
            continue
        if reason.startswith("reserve:cap") and n_groups <= (int(reason[len("reserve:cap"):]) + 1) * p.batch_size + p.redundancy:
            continue
        out.append(reason)
    return out


def checks(quick: bool) -> list[CheckResult]:
    """TLC state graph == mirror state graph, for the absolute and the lag model; each row also
    requires that every binding conjunct of Inv and of the Consume guard refused some step alone."""
    results = []
    for name, params, n_groups, max_version in MODELS_QUICK if quick else MODELS_FULL:
        bounds = f"Eta={params.eta} B={params.batch_size} X={params.redundancy} |Groups|={n_groups}" + (
            f" MaxVersion={max_version}" if max_version is not None else " (relative)")
        started = time.perf_counter()
        try:
            cmp = compare_graphs(params, n_groups, max_version)
        except TlcUnavailableError as error:
            results.append(CheckResult(f"graph-equivalence-{name}", "TLA+ spec == Python mirror",
                                       "TLC -dump dot vs mirror BFS", bounds, "0 states", "fail", 0.0, str(error)))
            continue
        expected = expected_refusals(params, n_groups, max_version is not None)
        missing = [r for r in expected if r not in cmp.refusals]
        detail = "0 mismatches" if cmp.equal else "; ".join(cmp.mismatches)
        detail += f"; refusal coverage: {len(expected) - len(missing)}/{len(expected)} binding conjuncts seen alone" + (
            f", never alone: {', '.join(missing)}" if missing else f" ({', '.join(expected)})")
        results.append(CheckResult(
            name=f"graph-equivalence-{name}",
            property="TLA+ spec == Python mirror: same states, same successors of every state; "
                     "every binding conjunct refused some step alone",
            method="TLC -dump dot vs BFS of spec/mirror.py",
            bounds=bounds,
            explored=f"{cmp.tlc_states:,} TLC states ({cmp.mirror_states:,} mirror), "
                     f"{cmp.tlc_edges:,} TLC edges ({cmp.mirror_edges:,} mirror)",
            result="pass" if cmp.equal and not missing else "fail",
            seconds=round(time.perf_counter() - started, 2),
            detail=detail,
        ))
    return results
