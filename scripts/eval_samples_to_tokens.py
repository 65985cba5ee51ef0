"""Turn sampled math-evaluation outputs into the samples file of ``staleflow bench draft-acceptance``.

One-off conversion, not used by the package or its tests. Its input is the output format of the
Qwen2.5-Math evaluation harness (``math_eval.py`` of QwenLM/Qwen2.5-Math and its forks): one JSON
object per line with the prompt's ``question`` and its sampled responses in ``code`` (a list: ``n``
samples of one prompt, or one sample of a prompt repeated ``x8`` in the data set). Responses of one
question in one file form a group; each is tokenized with Qwen2/2.5's own byte-level BPE and written
as ``{"group": id, "tokens": [ids]}``.

The vocabulary is Qwen's ``qwen.tiktoken`` (151,643 regular tokens, the same BPE and split pattern
as Qwen2/2.5's ``tokenizer.json``), shipped in the ``dashscope`` wheel on PyPI
(``dashscope/resources/qwen.tiktoken``). The script refuses a file that does not encode the known
strings of llama.cpp's Qwen2 vocabulary test (``models/ggml-vocab-qwen2.gguf.inp``/``.out``) to
their ids.

The figures of docs/simulation.md ("tau measured") come from the public evaluation outputs of
github.com/XinghanLi66/rl-sft at commit c981ccd10c5db8fd32c7c6b21680ff0f272bb49c: Qwen2.5-Math-1.5B,
AIME 2025 and AMC 2023 each repeated 8 times, one sample per line at temperature 0.6 (top-p 1,
3,072-token cap), in ``one-shot-em/results/1.5B-eval-promptoriginal/{aime25x8,amc23x8}/
test_qwen25-math-cot-tool_-1_seed0_t0.6_s0_e-1.jsonl`` (about 1.3 and 1.5 MB; not copied here):

    git clone https://github.com/XinghanLi66/rl-sft && git -C rl-sft checkout c981ccd10c5d
    pip download dashscope==2.0.2 --no-deps -d ds && unzip -o ds/dashscope-2.0.2-py3-none-any.whl \\
        dashscope/resources/qwen.tiktoken -d ds
    R=rl-sft/one-shot-em/results/1.5B-eval-promptoriginal F=test_qwen25-math-cot-tool_-1_seed0_t0.6_s0_e-1.jsonl
    python scripts/eval_samples_to_tokens.py --tiktoken ds/dashscope/resources/qwen.tiktoken \\
        --out samples.jsonl $R/aime25x8/$F $R/amc23x8/$F
    staleflow bench draft-acceptance --samples samples.jsonl

Needs ``tiktoken`` (installed with vLLM).
"""

from __future__ import annotations

import argparse
import base64
import json
import unicodedata
from pathlib import Path

#: Qwen's pre-tokenizer split (Qwen2/2.5's ``tokenizer.json`` uses the same, after NFC normalization)
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
REGULAR_TOKENS = 151_643
#: strings and ids from llama.cpp's Qwen2 vocabulary test (models/ggml-vocab-qwen2.gguf.inp/.out)
KNOWN = {
    "Hello world": [9707, 1879],
    " Hello world": [21927, 1879],
    "Führer": [37, 50753, 261],
    "ied 4 ½ months": [1122, 220, 19, 220, 26062, 3951],
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～": [
        9707, 11, 379, 64848, 0, 2585, 525, 498, 26525, 223, 937, 104100, 18493, 22377, 99257, 16, 18, 16, 19, 16, 20, 16,
        35727, 21216],
}


def qwen_encoder(path: Path):
    """An encoder of Qwen2/2.5's regular vocabulary, checked against :data:`KNOWN`."""
    import tiktoken

    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != REGULAR_TOKENS:
        raise SystemExit(f"{path}: {len(ranks)} tokens, Qwen2/2.5 has {REGULAR_TOKENS} regular tokens")
    encoding = tiktoken.Encoding("qwen", pat_str=SPLIT, mergeable_ranks=ranks, special_tokens={})

    def encode(text: str) -> list[int]:
        return encoding.encode_ordinary(unicodedata.normalize("NFC", text))

    wrong = [text for text, ids in KNOWN.items() if encode(text) != ids]
    if wrong:
        raise SystemExit(f"{path} does not encode {wrong} to Qwen2's ids")
    return encode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="evaluation output JSONL files (question, code)")
    parser.add_argument("--tiktoken", type=Path, required=True, help="qwen.tiktoken (from the dashscope wheel)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--drop-from", type=int, default=0,
                        help="leave out responses of this many tokens or more (the generation cap: truncated ones)")
    args = parser.parse_args()
    encode = qwen_encoder(args.tiktoken)
    groups: dict[str, list[list[int]]] = {}
    for path in args.outputs:
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                groups.setdefault(f"{path.parent.name}/{row['question']}", []).extend(encode(text) for text in row["code"])
    kept = dropped = tokens = 0
    with args.out.open("w") as out:
        for number, (_, responses) in enumerate(groups.items()):
            for ids in responses:
                if args.drop_from and len(ids) >= args.drop_from:
                    dropped += 1
                    continue
                out.write(json.dumps({"group": number, "tokens": ids}) + "\n")
                kept, tokens = kept + 1, tokens + len(ids)
    print(f"{len(groups)} groups, {kept} responses, {tokens / max(1, kept):.0f} tokens each on average"
          + (f", {dropped} of {args.drop_from} tokens or more left out" if args.drop_from else ""))


if __name__ == "__main__":
    main()
