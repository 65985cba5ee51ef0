"""Prompts and verifiable rewards: the built-in "repeat the letter" task and prompt files.

The built-in task (see ``shared/reference/cpu-rl-demo.md``): the prompt ``k*13=`` asks for thirteen
``k``; the count ``N`` is drawn log-uniformly from ``1..max_count`` so most answers are short and a
few are long (for ``max_count=64``: median 8, mean about 15, 90th percentile about 40). That long tail
is what makes a synchronous step wait on its stragglers.

Prompt files: JSON lines or Parquet, one prompt per row, with a non-empty string ``prompt`` and a
string ``answer`` (column names configurable). A malformed row is an error that names the file,
the row and the problem; nothing is skipped silently.

Rewards are plain functions ``reward(response_text, answer) -> float`` in ``[0, 1]``; the runtime
runs them under a timeout (``runtime/rewarding.py``).
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staleflow.runtime.types import PromptGroup

#: A rule-based reward: the decoded response and the reference answer -> a score in [0, 1].
RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class Prompt:
    """One task instance: the prompt text, its reference answer and anything else a row carried."""

    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- rewards
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


REWARDS: dict[str, RewardFn] = {
    "repeat_letter": repeat_letter_reward,
    "exact_match": exact_match_reward,
}


def reward_fn(name: str) -> RewardFn:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}") from None


# ---------------------------------------------------------------------------- the built-in task
def repeat_letter_count(rng: random.Random, max_count: int) -> int:
    """A long-tailed count in ``1..max_count``: log-uniform, so the median is ``sqrt(max_count)``."""
    return min(max_count, max(1, int(math.exp(rng.random() * math.log(max_count + 1)))))


def repeat_letter_prompt(letter: str, count: int) -> Prompt:
    return Prompt(text=f"{letter}*{count}=", answer=letter * count, metadata={"letter": letter, "count": count})


def repeat_letter_prompts(seed: int, max_count: int = 64) -> Iterator[Prompt]:
    """An endless, seeded stream of "repeat the letter" prompts."""
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    rng = random.Random(seed)
    while True:
        yield repeat_letter_prompt(rng.choice(string.ascii_lowercase), repeat_letter_count(rng, max_count))


# ---------------------------------------------------------------------------------- prompt files
class PromptFileError(ValueError):
    """A prompt file that cannot be used: missing, unreadable, or with a malformed row."""


def load_prompts(
    path: str | Path,
    *,
    encode: Callable[[str], Sequence[int]],
    max_prompt_tokens: int,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[Prompt]:
    """Read every row of a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file as a :class:`Prompt`.

    Each row needs a non-empty string ``prompt_key`` whose encoding has at most
    ``max_prompt_tokens`` tokens, and a string ``answer_key``; the other fields go into
    ``metadata``. Raises :class:`PromptFileError` naming the file and row for the first bad row.
    """
    file = Path(path)
    if not file.is_file():
        raise PromptFileError(f"prompt file {file} does not exist")
    suffix = file.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(file)
    elif suffix == ".parquet":
        rows = _parquet_rows(file)
    else:
        raise PromptFileError(f"{file}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")
    prompts: list[Prompt] = []
    for where, row in rows:
        prompts.append(_prompt_of_row(file, where, row, encode, max_prompt_tokens, prompt_key, answer_key))
    if not prompts:
        raise PromptFileError(f"{file} has no prompts")
    return prompts


def _jsonl_rows(file: Path) -> Iterator[tuple[str, Any]]:
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{file}: line {number} is not valid JSON ({err.msg})") from None


def _parquet_rows(file: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptFileError(f"{file}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    import pyarrow as pa

    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as err:
        raise PromptFileError(f"{file}: not a readable Parquet file ({err})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"row {number}", row


def _prompt_of_row(
    file: Path,
    where: str,
    row: Any,
    encode: Callable[[str], Sequence[int]],
    max_prompt_tokens: int,
    prompt_key: str,
    answer_key: str,
) -> Prompt:
    def fail(problem: str) -> PromptFileError:
        return PromptFileError(f"{file}: {where}: {problem}")

    if not isinstance(row, dict):
        raise fail(f"expected an object with {prompt_key!r} and {answer_key!r}, got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row or row[key] is None:
            raise fail(f"missing field {key!r}")
        if not isinstance(row[key], str):
            raise fail(f"field {key!r} must be a string, got {type(row[key]).__name__}")
    text = row[prompt_key]
    if not text.strip():
        raise fail(f"empty prompt in field {prompt_key!r}")
    n_tokens = len(encode(text))
    if n_tokens > max_prompt_tokens:
        raise fail(f"prompt has {n_tokens} tokens, more than max_prompt_tokens={max_prompt_tokens}")
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return Prompt(text=text, answer=row[answer_key], metadata=metadata)


def cycle_prompts(prompts: Sequence[Prompt], seed: int) -> Iterator[Prompt]:
    """Endless epochs over ``prompts``, reshuffled (seeded) at the start of each epoch."""
    if not prompts:
        raise ValueError("no prompts to cycle over")
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    while True:
        rng.shuffle(order)
        for i in order:
            yield prompts[i]


# --------------------------------------------------------------------------------- prompt groups
def make_group(
    prompt: Prompt,
    group_id: str,
    *,
    encode: Callable[[str], Sequence[int]],
    n_samples: int,
    max_new_tokens: int,
    n_extra: int = 0,
) -> PromptGroup:
    """A GRPO group for ``prompt``; its metadata carries the prompt text, the reference answer and
    the response token budget (``max_new_tokens``, read by the trajectory server)."""
    return PromptGroup(
        group_id=group_id,
        prompt_ids=list(encode(prompt.text)),
        n_samples=n_samples,
        n_extra=n_extra,
        metadata={**prompt.metadata, "prompt": prompt.text, "answer": prompt.answer, "max_new_tokens": max_new_tokens},
    )
