"""Prompt files: JSON lines or Parquet, one prompt per row, as RL data sets come (verl's format included).

A row's prompt (``prompt_key``) is a non-empty string or a list of chat messages
(``{"role": ..., "content": ...}``); its answer (``answer_key``) a string or a number. Both keys may
be dotted paths into nested rows (``reward_model.ground_truth``; a digit indexes a list). Chat
messages are rendered to the model's prompt text by ``render`` (the tokenizer's chat template, with
the generation prompt); strings are used as they are. ``solution_key`` (optional) names a worked
solution, the warm-up's supervised target.

A prompt longer than ``max_prompt_tokens`` is refused (``long_prompts="refuse"``, an error) or
skipped and counted (``"filter"``). Any other malformed row is an error that names the file, the
line (JSON lines) or row (Parquet) and the key; nothing is skipped silently.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from staleflow.runtime.tasks.builtin import Prompt
from staleflow.runtime.types import GroupId, PromptGroup

#: Renders chat messages (with the generation prompt) to the prompt text.
ChatRenderer = Callable[[list[dict[str, Any]]], str]
_MISSING = object()


class PromptFileError(ValueError):
    """A prompt file that cannot be used: missing, unreadable, or with a malformed row."""


@dataclass(frozen=True)
class PromptFile:
    """The prompts of a file and how many rows ``long_prompts="filter"`` skipped."""

    prompts: list[Prompt]
    filtered: int
    rows: int


def plain_render(messages: list[dict[str, Any]]) -> str:
    """Chat messages without a template: their contents, one per line."""
    return "\n".join(str(m["content"]) for m in messages)


def lookup(row: Any, dotted: str) -> Any:
    """The value at the dotted path ``dotted`` in ``row`` (a digit indexes a list), or ``_MISSING``."""
    node = row
    for part in dotted.split("."):
        if isinstance(node, dict):
            if part not in node:
                return _MISSING
            node = node[part]
        elif isinstance(node, list) and part.isdigit():
            if int(part) >= len(node):
                return _MISSING
            node = node[int(part)]
        else:
            return _MISSING
    return node


def read_prompt_file(
    path: str | Path,
    *,
    encode: Callable[[str], Sequence[int]],
    max_prompt_tokens: int,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    solution_key: str | None = None,
    render: ChatRenderer | None = None,
    long_prompts: Literal["refuse", "filter"] = "refuse",
) -> PromptFile:
    """Read every row of a ``.jsonl`` / ``.json`` (JSON lines) or ``.parquet`` file (see the module doc)."""
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
    keys = _Keys(prompt_key, answer_key, solution_key)
    prompts: list[Prompt] = []
    filtered = count = 0
    for where, row in rows:
        count += 1
        prompt = _prompt_of_row(file, where, row, keys, render or plain_render)
        n_tokens = len(encode(prompt.text))
        if n_tokens > max_prompt_tokens:
            if long_prompts == "filter":
                filtered += 1
                continue
            raise PromptFileError(
                f"{file}: {where}: prompt has {n_tokens} tokens, more than max_prompt_tokens={max_prompt_tokens} "
                "(task.long_prompts=filter skips such rows)"
            )
        prompts.append(prompt)
    if not prompts:
        detail = f" ({filtered} of {count} rows longer than max_prompt_tokens={max_prompt_tokens})" if filtered else ""
        raise PromptFileError(f"{file} has no prompts{detail}")
    return PromptFile(prompts, filtered, count)


def load_prompts(path: str | Path, *, encode: Callable[[str], Sequence[int]], max_prompt_tokens: int, **options: Any) -> list[Prompt]:
    """The prompts of :func:`read_prompt_file` (same arguments)."""
    return read_prompt_file(path, encode=encode, max_prompt_tokens=max_prompt_tokens, **options).prompts


@dataclass(frozen=True)
class _Keys:
    prompt: str
    answer: str
    solution: str | None


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


def _prompt_of_row(file: Path, where: str, row: Any, keys: _Keys, render: ChatRenderer) -> Prompt:
    def fail(problem: str) -> PromptFileError:
        return PromptFileError(f"{file}: {where}: {problem}")

    if not isinstance(row, dict):
        raise fail(f"expected an object with {keys.prompt!r} and {keys.answer!r}, got {type(row).__name__}")
    source = lookup(row, keys.prompt)
    if source is _MISSING or source is None:
        raise fail(f"missing field {keys.prompt!r}")
    if isinstance(source, str):
        if not source.strip():
            raise fail(f"empty prompt in field {keys.prompt!r}")
        text = source
    elif isinstance(source, list):
        _check_messages(source, keys.prompt, fail)
        text = render(source)
        if not text.strip():
            raise fail(f"field {keys.prompt!r} renders to an empty prompt")
    else:
        raise fail(f"field {keys.prompt!r} must be a string, got {type(source).__name__} (or a list of chat messages)")
    answer = _text_field(row, keys.answer, fail)
    target = _text_field(row, keys.solution, fail) if keys.solution else None
    top = {keys.prompt, keys.answer}
    metadata = {k: v for k, v in row.items() if k not in top}
    return Prompt(text=text, answer=answer, metadata=metadata, source=source, target=target)


def _text_field(row: dict[str, Any], key: str, fail: Callable[[str], PromptFileError]) -> str:
    value = lookup(row, key)
    if value is _MISSING or value is None:
        raise fail(f"missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise fail(f"field {key!r} must be a string, got {type(value).__name__}")
    return value if isinstance(value, str) else str(value)


def _check_messages(messages: list[Any], key: str, fail: Callable[[str], PromptFileError]) -> None:
    if not messages:
        raise fail(f"field {key!r} is an empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise fail(f"field {key}[{i}] must be a chat message {{'role': ..., 'content': ...}}, got {type(message).__name__}")
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                got = "missing" if part not in message else type(message[part]).__name__
                raise fail(f"field {key}[{i}].{part} must be a string ({got})")


# ---------------------------------------------------------------------------- streams and groups
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


def make_group(
    prompt: Prompt,
    group_id: GroupId,
    *,
    encode: Callable[[str], Sequence[int]],
    n_samples: int,
    max_new_tokens: int,
    n_extra: int = 0,
) -> PromptGroup:
    """A GRPO group for ``prompt``; its metadata carries the prompt text, the reference answer and
    the response token budget (``max_new_tokens``, read by the trajectory server), and, for a
    prompt from a file, the prompt as the row gave it (``source_prompt``, for user scorers)."""
    metadata = {**prompt.metadata, "prompt": prompt.text, "answer": prompt.answer, "max_new_tokens": max_new_tokens}
    if prompt.source is not None and prompt.source != prompt.text:
        metadata["source_prompt"] = prompt.source
    return PromptGroup(
        group_id=group_id,
        prompt_ids=list(encode(prompt.text)),
        n_samples=n_samples,
        n_extra=n_extra,
        metadata=metadata,
    )
