"""The trainer-only GPU check, run by ``scripts/gpu-smoke.sh --trainer-only``: the preflight
(:mod:`gpu_smoke_preflight`), then each trainer backend (``gpu_smoke_trainer.py``) in a process group
of its own under a time limit, then the verdict read from each backend's lines
(:mod:`gpu_smoke_verdict`): one ``gpu-smoke verdict:`` line per backend and ``GPU-SMOKE-VERDICT {json}``.

A backend that outlives its limit is ended with every process it started (its FSDP or Megatron ranks):
SIGTERM to its process group, SIGKILL after a grace period; the group is also killed after a normal
exit, so no rank outlives its backend. The limits share ``--total-s`` (330 s by default, each backend at
most ``--limit-s``), so the whole check ends within 6 minutes whatever hangs.

Exit status: 2 when the preflight refuses, else 0 when no backend failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gpu_smoke_preflight
from gpu_smoke_verdict import Outcome, describe, judge, verdict

BACKENDS = ("fsdp", "torch", "megatron")
#: seconds between SIGTERM and SIGKILL to a backend's process group
GRACE_S = 5.0


def end_group(group: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM to process group ``group``, SIGKILL to what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def run_limited(command: list[str], limit_s: float, backend: str, echo: bool = True) -> Outcome:
    """Run ``command`` in a new session (its own process group) for at most ``limit_s`` seconds,
    echoing and keeping its output lines; then end its group. Return code None: killed at the limit."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, bufsize=1)
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                print(line, end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: int | None = process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        returncode = None
    end_group(process.pid)  # at the limit, or ranks left behind by a backend that exited
    process.wait()
    reader.join(timeout=5)
    return Outcome(backend, returncode, list(lines), limit_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, help="one backend only (default: all three)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("SMOKE_STEPS", "12")))
    parser.add_argument("--limit-s", type=float, default=float(os.environ.get("SMOKE_BACKEND_LIMIT_S", "110")),
                        help="time limit of one backend, start-up and export included")
    parser.add_argument("--total-s", type=float, default=float(os.environ.get("SMOKE_TOTAL_S", "330")),
                        help="time limit of all backends together")
    parser.add_argument("--wheels", type=Path, default=Path("wheels"))
    parser.add_argument("--dry-run", action="store_true")
    args, rest = parser.parse_known_args(argv)
    backends = [args.backend] if args.backend else list(BACKENDS)
    needs = "cpu" if args.dry_run else args.device  # a dry run imports only: no GPU needed
    refused = gpu_smoke_preflight.main(["--backends", ",".join(backends), "--device", needs, "--wheels", str(args.wheels)])
    if refused:
        return refused
    trainer = str(Path(__file__).with_name("gpu_smoke_trainer.py"))
    started = time.monotonic()
    judgements = []
    for backend in backends:
        print(f"== gpu-smoke trainer: {backend} ==", flush=True)
        command = [sys.executable, trainer, "--backend", backend, "--device", args.device, "--steps", str(args.steps)]
        command += (["--dry-run"] if args.dry_run else []) + ([] if "--world-size" in rest else ["--world-size", "1"]) + rest
        limit_s = max(1.0, min(args.limit_s, args.total_s - (time.monotonic() - started)))
        judgements.append(judge(run_limited(command, limit_s, backend), args.steps))
    for judgement in judgements:
        print(describe(judgement))
    result = {**verdict(judgements), "seconds": round(time.monotonic() - started)}
    print("GPU-SMOKE-VERDICT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
