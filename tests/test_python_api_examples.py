"""The examples of docs/python.md (the protocol and the runtime from Python) run as printed and print
what their comments say."""

import contextlib
import io
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"


def test_protocol_example_runs_and_prints_what_it_claims() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert blocks, "docs/python.md has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "docs/python.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0] == "oldest version that can still reserve: None"
    assert lines[1] == "0 ('g2', 'g0') ()"
    assert lines[2] == "[(1, 2, 0, 0), (2, 1, 0, 1)]"
    assert lines[3].startswith("9 events; last: reserve CounterState(version=1")


def test_runtime_example_runs_and_prints_what_it_claims() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    example = next(b for b in blocks if "assemble_run" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "docs/python.md", "exec"), {})
    assert out.getvalue().splitlines() == ["5 True True"]
