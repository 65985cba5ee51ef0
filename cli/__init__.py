"""The ``staleflow`` subcommands: argument parsing and dispatch, nothing else.

Each subcommand is one module with ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code);
the work is done by :mod:`staleflow.app`. The root module :mod:`staleflow.__main__` builds the parser
from :data:`SUBCOMMANDS` and the benchmarks' ``bench`` subcommand, and dispatches.

Deferred imports: a ``run`` whose application module pulls torch, Ray, vLLM or matplotlib when it is
imported (``train``, ``profile``, ``export``, ``report``) imports it inside ``run``, once, so that
``staleflow --help`` and ``staleflow verify`` never load them. ``simulate``'s application module is
light (its engines and run loop are imported when a run starts), so it is imported at the top. No
other import in this package sits inside a function.
"""

from __future__ import annotations

from types import ModuleType

from staleflow.cli import export, profile, report, simulate, train
from staleflow.verification import cli as verify

#: subcommand -> (module that parses its arguments and runs it, one-line help)
SUBCOMMANDS: dict[str, tuple[ModuleType, str]] = {
    "verify": (verify, "machine-check the staleness protocol (Z3, TLC, conformance, mutants)"),
    "train": (train, "run an RL training job (no arguments: the built-in CPU job)"),
    "simulate": (simulate, "run StaleFlow and the baselines on a simulated cluster"),
    "profile": (profile, "measure a rollout engine and fit the cost model"),
    "report": (report, "rewrite a training run's report, or compare runs"),
    "export": (export, "write a run's trained model as a Hugging Face folder"),
}
