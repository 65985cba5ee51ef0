"""The result type every verification layer returns, and the table/JSON it is printed as."""

from __future__ import annotations

import builtins
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CheckResult:
    """One row of ``staleflow verify``.

    ``result`` is ``"pass"`` or ``"fail"``; a solver ``unknown``, a timeout or a crash is a fail
    and ``detail`` says which. ``explored`` counts states, examples, events or queries, with its unit
    (e.g. ``"612,542 distinct states"``).
    """

    name: str
    property: str
    method: str
    bounds: str
    explored: str
    result: str
    seconds: float
    detail: str = ""

    @builtins.property  # the field named ``property`` shadows the builtin inside the class body
    def ok(self) -> bool:
        return self.result == "pass"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
