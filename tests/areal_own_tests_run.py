"""AReaL's own unit tests of ``StalenessManager`` and ``RolloutController``, unedited, against the drop-in.

``python areal_own_tests_run.py AREAL_CHECKOUT OUT [--areal]``, with the python of AReaL's venv (the one
``tests/test_areal_dropin.py`` builds, with ``pytest`` added): copies ``tests/test_staleness_manager.py``,
``tests/test_rollout_controller.py`` and the helpers they import (``tests/__init__.py``, ``tests/utils.py``)
from a checkout of AReaL (https://github.com/inclusionAI/AReaL, at a commit whose ``areal/infra/staleness_manager.py``
is the installed ``areal==1.0.4``'s) into ``OUT``, beside a ``conftest.py`` that puts the drop-in under
AReaL's names as docs/integrating.md tells a user to (where AReaL builds a ``StalenessManager`` or a
``RolloutController``, build ``ProtocolStalenessManager`` or ``ProtocolRolloutController`` with the same
arguments), and runs them with pytest on CPU: the test marked ``sglang`` (a GPU inference server) is
deselected, and ``huggingface_hub.snapshot_download`` answers the model's name (AReaL's test helpers
download their models when imported; only that deselected test uses one). ``--areal`` runs the
same tests on AReaL's own classes. Prints each test's outcome, then one JSON line of counts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

COPIED = ("tests/__init__.py", "tests/utils.py", "tests/test_staleness_manager.py", "tests/test_rollout_controller.py")

SUBSTITUTION = '''
import huggingface_hub

huggingface_hub.snapshot_download = lambda repo_id, **kwargs: repo_id  # no model hub: a name nothing here reads

import areal.infra
import areal.infra.staleness_manager
from staleflow_protocol.bindings.areal import ProtocolRolloutController, ProtocolStalenessManager

if {substitute}:
    areal.infra.staleness_manager.StalenessManager = ProtocolStalenessManager
    areal.infra.RolloutController = ProtocolRolloutController
'''


def main(checkout: Path, out: Path, substitute: bool) -> None:
    shutil.rmtree(out, ignore_errors=True)
    for name in COPIED:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkout / name, out / name)
    (out / "conftest.py").write_text(SUBSTITUTION.format(substitute=substitute))
    report = out / "report.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "-m", "not sglang", *COPIED[2:]],
                          cwd=out, capture_output=True, text=True, timeout=1800)
    report.write_text(done.stdout + done.stderr)
    outcomes = [line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("PASSED ", "FAILED ", "ERROR "))]
    for outcome, test in outcomes:
        print(outcome, test.split(" - ")[0])
    counts = {kind: sum(outcome == kind for outcome, _ in outcomes) for kind in ("PASSED", "FAILED", "ERROR")}
    print(json.dumps({"substituted": substitute, **counts, "total": len(outcomes), "report": str(report)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), "--areal" not in sys.argv[3:])
