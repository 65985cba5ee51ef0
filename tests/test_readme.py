"""The README's protocol example runs as printed and prints what its comments say."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_protocol_example_runs_and_prints_what_it_claims() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0] == "oldest version that can still reserve: None"
    assert lines[1] == "0 ('g2', 'g0') ()"
    assert lines[2] == "[(1, 2, 0, 0), (2, 1, 0, 1)]"
    assert lines[3].startswith("9 events; last: reserve CounterState(version=1")


def test_readme_runtime_example_runs_and_prints_what_it_claims() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "assemble_run" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, "README.md", "exec"), {})
    assert out.getvalue().splitlines() == ["5 True True"]
