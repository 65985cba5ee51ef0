"""The built-in tasks: "repeat the letter" (the default job) and generated arithmetic word problems.

"Repeat the letter": the prompt ``k*13=`` asks for
thirteen ``k``; the count ``N`` is drawn log-uniformly from ``1..max_count`` so most answers are short
and a few are long (for ``max_count=64``: median 8, mean about 15, 90th percentile about 40). That long
tail is what makes a synchronous step wait on its stragglers.

Arithmetic word problems (:func:`arithmetic_rows`): GSM8K-shaped rows generated locally (no hub), in
verl's data format: ``prompt`` is a list of chat messages, the answer is under
``reward_model.ground_truth`` and the worked solution, ending in ``#### N``, under
``extra_info.answer``. The second built-in job (``runtime/settings/configs/arithmetic.yaml``) trains on them.
"""

from __future__ import annotations

import json
import math
import random
import string
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One task instance: the prompt text the model sees, its reference answer and the rest of the row.

    ``source`` is the prompt as the row gave it (a string or a list of chat messages; None for
    generated prompts): user scorers get it. ``target`` is the supervised target of the warm-up
    (a worked solution; None: the answer itself).
    """

    text: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    source: Any = None
    target: str | None = None


# ---------------------------------------------------------------------------- repeat the letter
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


# ------------------------------------------------------------------- arithmetic word problems
_NAMES = ("Ann", "Ben", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lea", "Max", "Ned", "Ola", "Pia")
_ITEMS = ("apples", "pens", "cards", "eggs", "books", "coins", "cups", "hats", "keys", "rocks", "shells", "stamps")
_MORE = ("buys {b} more", "finds {b} more", "gets {b} more", "is given {b} more")
_LESS = ("gives away {b}", "loses {b}", "sells {b}", "uses {b}")
ARITHMETIC_SOURCE = "staleflow/arithmetic"


def arithmetic_problem(rng: random.Random) -> tuple[str, str, int]:
    """One word problem: ``(question, worked solution ending in '#### N', N)``.

    ``a`` in 2..9 and ``b`` in 1..9, added or (when ``b < a``) subtracted: one step of arithmetic,
    with carries and borrows, which the tiny model gets partly right after its warm-up.
    """
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    if b < a and rng.random() < 0.5:
        action, result, sign = rng.choice(_LESS).format(b=b), a - b, "-"
    else:
        action, result, sign = rng.choice(_MORE).format(b=b), a + b, "+"
    question = f"{name} has {a} {item} and {action}. How many {item} now?"
    return question, f"{a}{sign}{b}={result}\n#### {result}", result


def arithmetic_rows(seed: int, count: int, split: str, exclude: Iterable[str] = ()) -> list[dict[str, Any]]:
    """``count`` verl-format rows (chat prompt, ``reward_model.ground_truth``, ``extra_info.answer``);
    questions in ``exclude`` (a held-out set's) are skipped."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    skip = set(exclude)
    while len(rows) < count:
        question, solution, result = arithmetic_problem(rng)
        if question in skip:
            continue
        index = len(rows)
        rows.append(
            {
                "data_source": ARITHMETIC_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": split, "index": index, "answer": solution},
            }
        )
    return rows


#: the shipped files of the second built-in job (``runtime/settings/configs/data/``): seeds and sizes
ARITHMETIC_FILES = {"arithmetic-eval.jsonl": (2, 200, "test"), "arithmetic-train.jsonl": (1, 1500, "train")}


def write_arithmetic_files(folder: str | Path) -> dict[str, Path]:
    """Write the second built-in job's data: a held-out eval file, then a training file without its questions."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    held_out: list[str] = []
    for name, (seed, count, split) in ARITHMETIC_FILES.items():
        rows = arithmetic_rows(seed, count, split, exclude=held_out)
        if split == "test":
            held_out = [row["prompt"][0]["content"] for row in rows]
        path = target / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        written[name] = path
    return written


if __name__ == "__main__":  # regenerate the shipped files: python -m staleflow.runtime.tasks.builtin DIR
    import sys

    shipped = Path(__file__).parents[1] / "settings" / "configs" / "data"
    for file in write_arithmetic_files(sys.argv[1] if len(sys.argv) > 1 else shipped).values():
        print(file)
