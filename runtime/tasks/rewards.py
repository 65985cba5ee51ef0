"""Verifiable rewards: the built-in scorers and users' own (``task.reward: module:function``).

Every scorer is called as ``score(prompt, response, answer, metadata) -> float``:

- ``prompt``: the row's prompt as the file gave it (a string, or the list of chat messages);
- ``response``: the decoded response (special tokens removed);
- ``answer``: the reference answer (the row's ``task.answer_key``, as a string);
- ``metadata``: the rest of the row (``data_source``, ``extra_info``, ...);

and returns a number (``int`` or ``float``, finite; ``bool`` is refused). It may be ``async def``.
Built-in scorers (:data:`BUILTIN_REWARDS`):

- ``exact_match``: 1 if the response equals the answer after stripping whitespace;
- ``repeat_letter``: the built-in task's graded reward;
- ``gsm8k``: 1 if the response's final ``#### N`` equals the answer numerically (``1,000`` = ``1000``
  = ``1000.0``); an answer that is itself a GSM8K solution counts by its own ``#### N``;
- ``math``: 1 if the response's answer (``\\boxed{...}``, or its last expression) is equivalent to the
  reference (LaTeX, fractions, sets...) according to the ``math-verify`` package.

The run loop calls them in worker processes (``runtime/run/rewarding.py``), so a slow or hanging scorer
cannot stall it; :func:`check_reward_spec` resolves a spec at start-up so a typo or an import error
stops the job before anything starts.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

#: A rule-based reward of the built-in kind: the decoded response and the reference answer -> score.
RewardFn = Callable[[str, str], float]
#: The scorer calling convention: ``(prompt, response, answer, metadata) -> float`` (or awaitable).
Scorer = Callable[[Any, str, str, dict[str, Any]], "float | Awaitable[float]"]


class RewardSpecError(ValueError):
    """A ``task.reward`` that cannot be used: unknown name, module not importable, not a function."""


class ScorerResultError(TypeError):
    """A scorer returned something that is not a finite number."""


# ------------------------------------------------------------------------------ built-in scorers
def repeat_letter_reward(response: str, answer: str) -> float:
    """1 if ``response == answer``; else ``0.5 * (1 - |len - N| / N) * fraction of correct letters``.

    ``answer`` is ``N`` copies of one letter; the length term is floored at 0 and an empty
    response scores 0. Partial credit gives the group advantages a gradient toward the right
    length and the right letter.
    """
    if not answer or answer != answer[0] * len(answer):
        raise ValueError(f"repeat_letter answer must be one letter repeated, got {answer!r}")
    if response == answer:
        return 1.0
    if not response:
        return 0.0
    n = len(answer)
    length_term = max(0.0, 1.0 - abs(len(response) - n) / n)
    letters = sum(1 for ch in response if ch == answer[0]) / len(response)
    return 0.5 * length_term * letters


def exact_match_reward(response: str, answer: str) -> float:
    """1 if the response equals the answer after stripping surrounding whitespace, else 0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


_FINAL = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")


def gsm8k_final_answer(text: str) -> Decimal | None:
    """The number after the last ``####`` in ``text`` (commas and a ``$`` allowed), or None."""
    found = _FINAL.findall(text)
    if not found:
        return None
    return _number(found[-1])


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def gsm8k_reward(response: str, answer: str) -> float:
    """1 if the response's final ``#### N`` equals the answer as a number, else 0 (GSM8K's strict format)."""
    expected = gsm8k_final_answer(answer) if "####" in answer else _number(answer)
    if expected is None:
        raise ValueError(f"gsm8k answer must be a number or end in '#### N', got {answer!r}")
    got = gsm8k_final_answer(response)
    return 1.0 if got is not None and got == expected else 0.0


def math_reward(response: str, answer: str) -> float:
    """1 if ``math-verify`` finds the response's answer equivalent to the reference, else 0."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise RewardSpecError("task.reward=math needs the math-verify package: pip install -e '.[rewards]'") from None
    # math-verify times out with SIGALRM, which works only in a process's main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "repeat_letter": repeat_letter_reward,
    "exact_match": exact_match_reward,
    "gsm8k": gsm8k_reward,
    "math": math_reward,
}
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_reward_spec(spec: str) -> bool:
    """Whether ``spec`` names a built-in reward or has the form ``module:function``."""
    return spec in BUILTIN_REWARDS or bool(_SPEC.match(spec))


# ------------------------------------------------------------------------------- resolving specs
def _builtin_scorer(fn: RewardFn) -> Scorer:
    def score(prompt: Any, response: str, answer: str, metadata: dict[str, Any]) -> float:
        return fn(response, answer)

    score.__name__ = fn.__name__
    return score


def resolve_scorer(spec: str) -> Scorer:
    """The scorer that ``task.reward`` names: a built-in name or ``module:function`` (importable). The one
    place a reward spec is resolved: the scorer processes, the start-up check and every evaluator call it."""
    if spec in BUILTIN_REWARDS:
        return _builtin_scorer(BUILTIN_REWARDS[spec])
    if not _SPEC.match(spec):
        raise RewardSpecError(
            f"task.reward={spec!r}: use one of {', '.join(BUILTIN_REWARDS)} or 'module:function' (e.g. my_rewards:score)"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's module's
        raise RewardSpecError(
            f"task.reward={spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            "is it on PYTHONPATH (or in the directory you run from)?"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise RewardSpecError(f"task.reward={spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise RewardSpecError(f"task.reward={spec!r}: {attr!r} is a {type(target).__name__}, not a function")
    try:
        inspect.signature(target).bind(None, "", "", {})
    except TypeError:
        raise RewardSpecError(
            f"task.reward={spec!r}: {attr}{inspect.signature(target)} cannot be called as "
            "score(prompt, response, answer, metadata)"
        ) from None
    except ValueError:  # builtins without a signature: take them as they are
        pass
    return target  # type: ignore[no-any-return]


def check_reward_spec(spec: str) -> None:
    """Raise :class:`RewardSpecError` now if ``spec`` cannot be resolved (start-up check)."""
    resolve_scorer(spec)
    if spec == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise RewardSpecError("task.reward=math needs the math-verify package: pip install -e '.[rewards]'") from None


def as_reward(value: Any, spec: str) -> float:
    """``value`` as a reward, or :class:`ScorerResultError` naming the scorer and what it returned."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScorerResultError(f"scorer {spec!r} returned {type(value).__name__} ({value!r:.60}), not a number")
    if not math.isfinite(value):
        raise ScorerResultError(f"scorer {spec!r} returned {value}, not a finite number")
    return float(value)


def score_items(spec: str, scorer: Scorer, items: Sequence[tuple[Any, str, str, dict[str, Any]]]) -> list[float]:
    """Score every ``(prompt, response, answer, metadata)``; async scorers run concurrently."""
    results: list[Any] = [scorer(*item) for item in items]
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(results[i] for i in pending)))

        for i, value in zip(pending, asyncio.run(gather())):
            results[i] = value
    return [as_reward(value, spec) for value in results]
