"""The built-in task's reward and long tail, and prompt files with malformed rows."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
from skips import require
from staleflow.runtime.tasks import (
    PromptFileError,
    cycle_prompts,
    exact_match_reward,
    load_prompts,
    make_group,
    repeat_letter_prompts,
    repeat_letter_reward,
    resolve_scorer,
)


def encode(text: str) -> list[int]:
    return [4 + b for b in text.encode("utf-8")]


def test_repeat_letter_reward_values() -> None:
    answer = "k" * 10
    assert repeat_letter_reward("k" * 10, answer) == 1.0
    assert repeat_letter_reward("", answer) == 0.0
    # 8 letters, all right: 0.5 * (1 - 2/10) * 1
    assert repeat_letter_reward("k" * 8, answer) == pytest.approx(0.4)
    # 10 letters, half wrong: 0.5 * 1 * 0.5
    assert repeat_letter_reward("kkkkkxxxxx", answer) == pytest.approx(0.25)
    # 25 letters: length term floored at 0
    assert repeat_letter_reward("k" * 25, answer) == 0.0
    # 12 letters of which 9 right: 0.5 * 0.8 * 0.75
    assert repeat_letter_reward("k" * 9 + "abc", answer) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="one letter repeated"):
        repeat_letter_reward("ab", "ab")


def test_exact_match_and_reward_lookup() -> None:
    assert exact_match_reward(" 42\n", "42") == 1.0
    assert exact_match_reward("41", "42") == 0.0
    assert resolve_scorer("repeat_letter")("prompt", "aaa", "aaa", {}) == 1.0
    assert resolve_scorer("exact_match")("prompt", "41", "42", {}) == 0.0
    with pytest.raises(ValueError, match="task.reward='bleu': use one of repeat_letter, exact_match"):
        resolve_scorer("bleu")


def test_repeat_letter_prompts_are_long_tailed_and_seeded() -> None:
    prompts = list(itertools.islice(repeat_letter_prompts(seed=1), 20000))
    counts = [p.metadata["count"] for p in prompts]
    assert min(counts) == 1 and max(counts) == 64
    assert 7 <= statistics.median(counts) <= 9
    assert 13 <= statistics.mean(counts) <= 17
    p90 = sorted(counts)[int(0.9 * len(counts))]
    assert 35 <= p90 <= 45
    first = prompts[0]
    assert (
        first.text == f"{first.metadata['letter']}*{first.metadata['count']}="
        and first.answer == first.metadata["letter"] * first.metadata["count"]
    )
    again = list(itertools.islice(repeat_letter_prompts(seed=1), 5))
    assert again == prompts[:5]
    assert list(itertools.islice(repeat_letter_prompts(seed=2), 5)) != prompts[:5]


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_load_prompts_from_jsonl(tmp_path: Path) -> None:
    file = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4", "source": "x"}, "", {"prompt": "a*3=", "answer": "aaa"}])
    prompts = load_prompts(file, encode=encode, max_prompt_tokens=16)
    assert [(p.text, p.answer, p.metadata) for p in prompts] == [("2+2=", "4", {"source": "x"}), ("a*3=", "aaa", {})]
    group = make_group(prompts[0], "g7", encode=encode, n_samples=8, n_extra=2, max_new_tokens=16)
    assert group.prompt_ids == encode("2+2=") and group.n_samples == 8 and group.n_extra == 2
    assert group.metadata == {"prompt": "2+2=", "answer": "4", "source": "x", "max_new_tokens": 16}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"answer": "4"}, "line 2: missing field 'prompt'"),
        ({"prompt": "2+2="}, "line 2: missing field 'answer'"),
        ({"prompt": "   ", "answer": "4"}, "line 2: empty prompt"),
        ({"prompt": 5, "answer": "4"}, "line 2: field 'prompt' must be a string, got int"),
        ({"prompt": "x" * 17, "answer": "4"}, "line 2: prompt has 17 tokens, more than max_prompt_tokens=16"),
        ([1, 2], "line 2: expected an object"),
        ("{not json", "line 2 is not valid JSON"),
    ],
)
def test_load_prompts_names_the_bad_row(tmp_path: Path, row: object, message: str) -> None:
    file = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok", "answer": "ok"}, row])
    with pytest.raises(PromptFileError, match=message.replace("(", r"\(").replace("+", r"\+")):
        load_prompts(file, encode=encode, max_prompt_tokens=16)


def test_load_prompts_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl", encode=encode, max_prompt_tokens=16)
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(PromptFileError, match="unsupported prompt file type '.csv'"):
        load_prompts(tmp_path / "p.csv", encode=encode, max_prompt_tokens=16)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptFileError, match="has no prompts"):
        load_prompts(tmp_path / "empty.jsonl", encode=encode, max_prompt_tokens=16)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    require("pyarrow", "data")
    with pytest.raises(PromptFileError, match="not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet", encode=encode, max_prompt_tokens=16)


def test_load_prompts_from_parquet(tmp_path: Path) -> None:
    pa = require("pyarrow", "data")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["b*2=", "c*1="], "target": ["bb", "c"]}), tmp_path / "p.parquet")
    prompts = load_prompts(tmp_path / "p.parquet", encode=encode, max_prompt_tokens=8, prompt_key="question", answer_key="target")
    assert [(p.text, p.answer) for p in prompts] == [("b*2=", "bb"), ("c*1=", "c")]
    pq.write_table(pa.table({"question": ["b*2=", None], "target": ["bb", "c"]}), tmp_path / "q.parquet")
    with pytest.raises(PromptFileError, match="row 2: missing field 'question'"):
        load_prompts(tmp_path / "q.parquet", encode=encode, max_prompt_tokens=8, prompt_key="question", answer_key="target")


def test_cycle_prompts_visits_every_prompt_each_epoch() -> None:
    prompts = list(itertools.islice(repeat_letter_prompts(seed=0), 5))
    seen = list(itertools.islice(cycle_prompts(prompts, seed=3), 10))
    assert sorted(p.text for p in seen[:5]) == sorted(p.text for p in prompts)
    assert sorted(p.text for p in seen[5:]) == sorted(p.text for p in prompts)
