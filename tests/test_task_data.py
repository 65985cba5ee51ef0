"""Prompt files as RL data sets come: dotted keys, chat-message prompts rendered by a template,
verl-format GSM8K/MATH rows as they are, the prompt-length policy (refuse or filter with a count),
and malformed rows rejected with the file, line and key; the shipped arithmetic job's data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from skips import require
from staleflow.runtime.tasks import (
    PromptFileError,
    arithmetic_rows,
    gsm8k_reward,
    lookup,
    make_group,
    read_prompt_file,
)
from staleflow.runtime.tasks.builtin import ARITHMETIC_FILES, write_arithmetic_files

DATA = Path(__file__).resolve().parents[1] / "runtime" / "settings" / "configs" / "data"
GSM8K_ROW = {  # a row of verl's examples/data_preprocess/gsm8k.py, as it writes them
    "data_source": "openai/gsm8k",
    "prompt": [
        {
            "role": "user",
            "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Let's think step by step and output the final "
            'answer after "####".',
        }
    ],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0, "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"},
}
MATH_ROW = {
    "data_source": "DigitalLearningGmbH/MATH-lighteval",
    "prompt": [{"role": "user", "content": "What is $\\frac{1}{2}+\\frac{1}{4}$? Let's think step by step."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"},
    "extra_info": {"split": "test", "index": 3},
}


def encode(text: str) -> list[int]:
    return [4 + b for b in text.encode("utf-8")]


def template(messages: list[dict]) -> str:
    """A stand-in chat template with a generation prompt."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


VERL = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth", "render": template}


def test_lookup_dotted_paths() -> None:
    assert lookup(GSM8K_ROW, "reward_model.ground_truth") == "72"
    assert lookup(GSM8K_ROW, "prompt.0.role") == "user"
    assert lookup(GSM8K_ROW, "extra_info.split") == "train"
    assert lookup(GSM8K_ROW, "reward_model.missing") is lookup(GSM8K_ROW, "prompt.5")  # both absent


def test_verl_gsm8k_and_math_rows_load_as_they_are(tmp_path: Path) -> None:
    file = _write(tmp_path / "verl.jsonl", [GSM8K_ROW, MATH_ROW])
    loaded = read_prompt_file(file, encode=encode, max_prompt_tokens=512, solution_key=None, **VERL)
    gsm8k, math = loaded.prompts
    assert gsm8k.text == f"<|user|>{GSM8K_ROW['prompt'][0]['content']}\n<|assistant|>"
    assert gsm8k.answer == "72" and math.answer == "\\frac{3}{4}"
    assert gsm8k.source == GSM8K_ROW["prompt"]
    assert gsm8k.metadata["data_source"] == "openai/gsm8k" and gsm8k.metadata["extra_info"]["index"] == 0
    group = make_group(gsm8k, "g0", encode=encode, n_samples=4, max_new_tokens=32)
    assert group.prompt_ids == encode(gsm8k.text)
    assert group.metadata["answer"] == "72" and group.metadata["source_prompt"] == GSM8K_ROW["prompt"]
    # the case: a correct GSM8K answer ending in '#### 72' against the row's ground truth
    assert gsm8k_reward(GSM8K_ROW["extra_info"]["answer"], gsm8k.answer) == 1.0
    only_gsm8k = _write(tmp_path / "gsm8k.jsonl", [GSM8K_ROW])
    with_solution = read_prompt_file(only_gsm8k, encode=encode, max_prompt_tokens=512, **VERL, solution_key="extra_info.answer")
    assert with_solution.prompts[0].target == GSM8K_ROW["extra_info"]["answer"]
    with pytest.raises(PromptFileError, match="verl.jsonl: line 2: missing field 'extra_info.answer'"):  # MATH rows have none
        read_prompt_file(file, encode=encode, max_prompt_tokens=512, **VERL, solution_key="extra_info.answer")


def test_without_a_template_messages_are_their_contents(tmp_path: Path) -> None:
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}], "answer": 4}
    (prompt,) = read_prompt_file(_write(tmp_path / "p.jsonl", [row]), encode=encode, max_prompt_tokens=64).prompts
    assert prompt.text == "Be brief.\n2+2=" and prompt.answer == "4"  # a number answer is taken as its text


def test_long_prompts_refused_or_filtered_with_a_count(tmp_path: Path) -> None:
    rows = [{"prompt": "x" * n, "answer": "a"} for n in (4, 20, 8, 30)]
    file = _write(tmp_path / "p.jsonl", rows)
    with pytest.raises(PromptFileError, match=r"p.jsonl: line 2: prompt has 20 tokens, more than max_prompt_tokens=16"):
        read_prompt_file(file, encode=encode, max_prompt_tokens=16)
    loaded = read_prompt_file(file, encode=encode, max_prompt_tokens=16, long_prompts="filter")
    assert [len(p.text) for p in loaded.prompts] == [4, 8] and (loaded.filtered, loaded.rows) == (2, 4)
    with pytest.raises(PromptFileError, match=r"has no prompts \(4 of 4 rows longer than max_prompt_tokens=2\)"):
        read_prompt_file(file, encode=encode, max_prompt_tokens=2, long_prompts="filter")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {}}, "line 2: missing field 'reward_model.ground_truth'"),
        ({"prompt": [{"role": "user", "content": "q"}]}, "line 2: missing field 'reward_model.ground_truth'"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "line 2: field 'prompt' is an empty list of chat messages"),
        ({"prompt": ["hi"], "reward_model": {"ground_truth": "1"}}, r"line 2: field prompt\[0\] must be a chat message"),
        (
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}},
            r"line 2: field prompt\[0\].content must be a string \(missing\)",
        ),
        (
            {"prompt": [{"role": 1, "content": "q"}], "reward_model": {"ground_truth": "1"}},
            r"line 2: field prompt\[0\].role must be a string \(int\)",
        ),
        ({"prompt": {"text": "q"}, "reward_model": {"ground_truth": "1"}}, "line 2: field 'prompt' must be a string, got dict"),
        ({"prompt": "q", "reward_model": {"ground_truth": ["1"]}}, "line 2: field 'reward_model.ground_truth' must be a string, got list"),
        ({"prompt": "q", "reward_model": {"ground_truth": True}}, "line 2: field 'reward_model.ground_truth' must be a string, got bool"),
    ],
)
def test_malformed_rows_name_file_line_and_key(tmp_path: Path, row: object, message: str) -> None:
    file = _write(tmp_path / "bad.jsonl", [GSM8K_ROW, row])
    with pytest.raises(PromptFileError, match=f"bad.jsonl: {message}"):
        read_prompt_file(file, encode=encode, max_prompt_tokens=512, **VERL)


def test_verl_rows_from_parquet(tmp_path: Path) -> None:
    pa = require("pyarrow", "data")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([GSM8K_ROW, MATH_ROW]), tmp_path / "train.parquet")
    loaded = read_prompt_file(tmp_path / "train.parquet", encode=encode, max_prompt_tokens=512, **VERL)
    assert [p.answer for p in loaded.prompts] == ["72", "\\frac{3}{4}"]
    assert loaded.prompts[0].source[0]["role"] == "user"


def test_arithmetic_rows_are_gsm8k_shaped_and_the_shipped_files_are_current(tmp_path: Path) -> None:
    rows = arithmetic_rows(seed=5, count=50, split="train")
    for row in rows:
        solution, truth = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert solution.endswith(f"#### {truth}") and gsm8k_reward(solution, truth) == 1.0
        assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith("now?")
    written = write_arithmetic_files(tmp_path)
    for name in ARITHMETIC_FILES:
        assert written[name].read_text() == (DATA / name).read_text(), f"regenerate: python -m staleflow.runtime.tasks.builtin ({name})"
    held_out = {json.loads(line)["prompt"][0]["content"] for line in (DATA / "arithmetic-eval.jsonl").read_text().splitlines()}
    train = {json.loads(line)["prompt"][0]["content"] for line in (DATA / "arithmetic-train.jsonl").read_text().splitlines()}
    assert len(held_out) > 150 and not held_out & train
