"""The sibling proposer's memory (``runtime/drafts.py``): rows recognised from step to step by their
tokens alone, drafts from a finished or running sibling of the same prompt, never from another
prompt's responses, and the own response and prompt as the fallback; the compact index drafts what a
dict of every n-gram drafts, in about 20 bytes a token."""

from __future__ import annotations

import bisect
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from skips import needs
from staleflow.runtime.drafts import SiblingDrafts, SuffixIndex, longest_match
from staleflow.runtime.settings.config_sections import SIBLING_PROPOSER, RolloutConfig

PROMPT = list(range(1, 11))
OTHER_PROMPT = list(range(50, 60))
RESPONSE = list(range(20, 40))


def _grow(drafts: SiblingDrafts, prompt: list[int], response: list[int], k: int = 4) -> list[int]:
    """Run one request alone through ``drafts``, a token a step, to the end of ``response``; its last draft."""
    last: list[int] = []
    for t in range(1, len(response) + 1):
        (last,) = drafts.propose([prompt + response[:t]], k)
    return last


def test_a_finished_sibling_drafts_for_a_new_request_of_the_same_prompt() -> None:
    drafts = SiblingDrafts(lookback=10, capacity=16)
    _grow(drafts, PROMPT, RESPONSE)
    assert drafts.from_siblings == 0  # alone: nothing to read but its own tokens
    assert drafts.propose([PROMPT + RESPONSE[:1]], 4) == [RESPONSE[1:5]]  # the first one has left the batch
    assert drafts.from_siblings == 4
    # four drafts accepted, and one token of its own: the row grew by five, and is still the same request
    assert drafts.propose([PROMPT + RESPONSE[:6]], 4) == [RESPONSE[6:10]]
    assert drafts.from_siblings == 8


def test_a_running_sibling_ahead_drafts_and_both_rows_stay_recognised() -> None:
    drafts = SiblingDrafts(lookback=10, capacity=16)
    _grow(drafts, PROMPT, RESPONSE[:6])
    ahead, behind = drafts.propose([PROMPT + RESPONSE[:7], PROMPT + RESPONSE[:1]], 3)
    assert behind == RESPONSE[1:4]
    assert ahead == []  # the one ahead has nothing to read: no repeat, its sibling is behind it
    ahead, behind = drafts.propose([PROMPT + RESPONSE[:8], PROMPT + RESPONSE[:4]], 3)
    assert behind == RESPONSE[4:7]


def test_identical_siblings_in_one_step_are_two_requests() -> None:
    """Two rows with the same tokens (greedy siblings in lockstep) are tracked apart: once they part,
    each is still recognised, and a third request of the prompt follows the branch it is on."""
    drafts = SiblingDrafts(lookback=10, capacity=16)
    for t in range(1, 5):
        drafts.propose([PROMPT + RESPONSE[:t], PROMPT + RESPONSE[:t]], 4)
    for t in range(1, 4):
        drafts.propose([PROMPT + RESPONSE[:4] + [70, 71, 72][:t], PROMPT + RESPONSE[:4] + [80, 81, 82][:t]], 4)
    assert _grow(drafts, PROMPT, RESPONSE[:4] + [80]) == [81, 82]
    assert drafts.from_siblings > 0


def test_a_request_resubmitted_with_its_partial_response_is_the_same_sequence() -> None:
    """An interrupted request comes back (to the same engine) with its partial response in its prompt:
    its first row then holds one token more than when it left, and it is still its group's."""
    drafts = SiblingDrafts(lookback=10, capacity=16)
    _grow(drafts, PROMPT, RESPONSE)
    _grow(drafts, PROMPT, RESPONSE[:5])
    drafts.propose([OTHER_PROMPT + [1]], 4)  # a step without it
    assert drafts.propose([PROMPT + RESPONSE[:6]], 4) == [RESPONSE[6:10]]


def test_nothing_is_drafted_from_another_prompts_responses() -> None:
    drafts = SiblingDrafts(lookback=10, capacity=16)
    _grow(drafts, PROMPT, RESPONSE)
    assert drafts.propose([OTHER_PROMPT + RESPONSE[:1]], 4) == [[]]
    assert drafts.propose([OTHER_PROMPT + RESPONSE[:2]], 4) == [[]]
    assert drafts.from_siblings == 0


def test_the_own_response_then_the_prompt_are_the_fallback() -> None:
    drafts = SiblingDrafts(lookback=10, capacity=16)
    assert _grow(drafts, PROMPT, [30, 31, 32, 30, 31]) == [32, 30, 31]  # its own repeat (what n-gram drafts)
    prompt = list(range(1, 21))
    assert drafts.propose([prompt + [3]], 4) == [[4, 5, 6, 7]]  # '3' occurs in the prompt only
    assert drafts.from_siblings == 0


def test_a_sibling_drafts_from_where_it_stands_not_from_the_last_repeat() -> None:
    """In a sibling that holds the row's last eight tokens twice, the draft follows the occurrence
    aligned with the row (60, 61), not the sibling's last one (62, 63)."""
    repeated = [40, 41, 42, 43, 44, 45, 46, 47]
    sibling = [21, *repeated, 60, 61, 22, 23, *repeated, 62, 63]
    drafts = SiblingDrafts(lookback=10, capacity=16)
    _grow(drafts, PROMPT, sibling)
    assert _grow(drafts, PROMPT, sibling[:9], k=2) == [60, 61]


def test_the_least_recently_seen_sequences_leave_first() -> None:
    drafts = SiblingDrafts(lookback=10, capacity=2)
    _grow(drafts, PROMPT, RESPONSE)
    _grow(drafts, OTHER_PROMPT, RESPONSE[:2])
    _grow(drafts, [7] + OTHER_PROMPT, RESPONSE[:2])  # a third sequence: the first one is dropped
    assert drafts.propose([PROMPT + RESPONSE[:1]], 4) == [[]]


def test_an_index_grown_piece_by_piece_is_the_index_of_the_whole() -> None:
    tokens = [1, 2, 1, 2, 3, 1, 2, 3, 4]
    grown = SuffixIndex(tokens[:2], max_match=3)
    grown.extend(tokens[2:5])
    grown.extend(tokens[5:])
    assert grown.tokens.tolist() == tokens and len(grown) == len(tokens)
    with pytest.raises(ValueError, match="token ids must lie in"):
        grown.extend([5, -1])  # a token id the packed keys cannot hold: nothing appended
    assert grown.tokens.tolist() == tokens
    assert grown.continuation((1, 2), len(tokens), 2) == [3, 4]  # the last occurrence
    assert grown.continuation((1, 2), len(tokens), 2, near=3) == [1, 2]  # the one nearest position 3


def test_rows_a_step_and_requests_without_drafts_are_recorded() -> None:
    """``None`` rows (in prefill) draft nothing; ``k`` 0 (a batch above the schedule's) records only."""
    drafts = SiblingDrafts(lookback=10, capacity=16)
    for t in range(1, len(RESPONSE) + 1):
        assert drafts.propose([PROMPT + RESPONSE[:t], None], 0) == [[], []]
    assert drafts.proposed == 0
    assert drafts.propose([PROMPT + RESPONSE[:1]], 2) == [RESPONSE[1:3]]
    with pytest.raises(ValueError, match="lookback, capacity and max_match"):
        SiblingDrafts(lookback=0, capacity=1)


def test_the_siblings_method_is_vllms_custom_class_with_our_proposer() -> None:
    from pydantic import ValidationError

    spec = RolloutConfig(max_num_seqs=64, speculation={"method": "siblings", "tokens": 3}).engine_settings()["speculative_config"]
    assert spec == {"method": "custom_class", "model": SIBLING_PROPOSER, "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 8, 3], [9, 64, 0]]}
    module, name = SIBLING_PROPOSER.rsplit(".", 1)
    assert callable(getattr(__import__(module, fromlist=[name]), name).propose)
    with pytest.raises(ValidationError, match="'ngram', 'suffix' or 'siblings'"):
        RolloutConfig(speculation={"method": "sibling"})



@needs("vllm", "cpu-infer")
def test_the_vllm_proposer_follows_the_batch_size_schedule_and_the_model_length() -> None:
    """vLLM tells a custom proposer neither how many drafts a step takes nor anything but the token
    array and lengths: ours looks the batch's size up in ``num_speculative_tokens_per_batch_size``
    (no drafts for a batch of 9 above ``max_batch`` 8) and drafts no token past ``max_model_len``."""
    from types import SimpleNamespace

    import numpy as np
    from staleflow.adapters.vllm.sibling_drafts import SiblingProposer

    spec = RolloutConfig(max_num_seqs=16, speculation={"method": "siblings", "max_batch": 8}).engine_settings()["speculative_config"]
    proposer = SiblingProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4,
                                           num_speculative_tokens_per_batch_size=spec["num_speculative_tokens_per_batch_size"]),
        scheduler_config=SimpleNamespace(max_num_seqs=16), model_config=SimpleNamespace(max_model_len=20)))
    tokens = np.zeros((16, 20), dtype=np.int32)

    def step(rows: list[list[int]]) -> list[list[int]]:
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        return proposer.propose([[row[-1]] for row in rows], np.array([len(row) for row in rows]), tokens)

    for t in range(1, 9):
        step([PROMPT + RESPONSE[:t]])  # one response of 8 tokens, alone
    assert step([PROMPT + RESPONSE[:1]] * 9) == [[]] * 9  # nine siblings start: above max_batch, no drafts
    assert step([PROMPT + RESPONSE[:2]] * 2)[0] == RESPONSE[2:6]  # two of them go on: 4 drafts from the first
    looping = [30, 31, 32, 33, 34, 30, 31, 32]
    for t in range(1, len(looping)):
        step([OTHER_PROMPT + looping[:t]])
    assert step([OTHER_PROMPT + looping]) == [[33, 34]]  # its own repeat has [33, 34, 30, 31]: 18 + 2 = max_model_len


class _NgramIndex:
    """The index as it began (a dict of every n-gram's end positions): what :class:`SuffixIndex` must draft."""

    def __init__(self, tokens: list[int], max_match: int) -> None:
        self.tokens, self.max_match, self.ends = list(tokens), max_match, {}
        for end in range(1, len(tokens) + 1):
            for n in range(1, min(max_match, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)

    def continuation(self, pattern: tuple[int, ...], readable: int, k: int, near: int | None = None) -> list[int]:
        ends = self.ends.get(pattern, ())
        i = bisect.bisect_left(ends, readable) - 1
        if i < 0:
            return []
        if near is not None:
            after = bisect.bisect_right(ends, near, 0, i + 1)
            i = after if after <= i and (after == 0 or ends[after] - near < near - ends[after - 1]) else after - 1
        end = ends[i]
        return self.tokens[end : min(end + k, readable)]


def _ngram_longest_match(context: list[int], sources: list, k: int, max_match: int) -> tuple[list[int], int]:
    for n in range(min(max_match, len(context)), 0, -1):
        pattern = tuple(context[len(context) - n :])
        for position, (index, readable, near) in enumerate(sources):
            found = index.continuation(pattern, readable, k, near) if readable else []
            if found:
                return found, position
    return [], -1


@st.composite
def _texts(draw: st.DrawFn) -> list[int]:
    """A token sequence that repeats pieces of itself (so that long matches occur), of a small vocabulary
    or a larger one, up to 400 tokens (so that the index sorts its tail in, and has many candidates)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    vocab, length = draw(st.sampled_from([1, 2, 3, 6, 50])), draw(st.integers(0, 400))
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.3:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randint(1, 12)]
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


def _grown(tokens: list[int], max_match: int, rng: random.Random) -> SuffixIndex:
    """``tokens`` indexed in pieces of random sizes (a token at a time to the whole at once)."""
    index, done = SuffixIndex((), max_match), 0
    while done < len(tokens):
        piece = rng.choice([1, 1, 1, 2, 5, 40, 200])
        index.extend(tokens[done : done + piece])
        done += piece
    return index


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(_texts(), min_size=1, max_size=4), seed=st.integers(0, 2**32))
def test_the_compact_index_drafts_what_a_dict_of_every_ngram_drafts(texts: list[list[int]], seed: int) -> None:
    """On random sequences grown by ``extend`` in random pieces, every continuation (random patterns,
    ``readable`` bounds, ``near`` positions and ``k``) and every longest match over several sources are
    the n-gram dict's: the same tokens from the same occurrence, ties broken the same way."""
    rng = random.Random(seed)
    max_matches = [rng.randint(1, 9) for _ in texts]
    compact = [_grown(tokens, m, rng) for tokens, m in zip(texts, max_matches, strict=True)]
    reference = [_NgramIndex(tokens, m) for tokens, m in zip(texts, max_matches, strict=True)]
    assert [index.tokens.tolist() for index in compact] == texts

    def query(tokens: list[int]) -> tuple[list[int], int, int | None, int]:
        start = rng.randint(0, len(tokens))
        pattern = tokens[start : start + rng.randint(0, 10)] + ([rng.randrange(60)] if rng.random() < 0.2 else [])
        near = None if rng.random() < 0.4 else rng.randint(-2, len(tokens) + 2)
        return pattern, rng.randint(-1, len(tokens)), near, rng.randint(0, 5)

    for _ in range(30):
        i = rng.randrange(len(texts))
        pattern, readable, near, k = query(texts[i])
        assert compact[i].continuation(pattern, readable, k, near) == reference[i].continuation(tuple(pattern), readable, k, near)
        context, _, _, k = query(texts[rng.randrange(len(texts))])
        sources = [(i, rng.randint(-1, len(texts[i])), None if rng.random() < 0.5 else rng.randint(0, 400)) for i in range(len(texts))]
        rng.shuffle(sources)
        max_match = rng.randint(0, 10)
        assert longest_match(context, [(compact[i], r, n) for i, r, n in sources], k, max_match) == _ngram_longest_match(
            context, [(reference[i], r, n) for i, r, n in sources], k, max_match)


@pytest.mark.parametrize("vocab", [50, 32_000])
def test_an_index_holds_under_100_bytes_a_token(vocab: int) -> None:
    """20,000 tokens indexed at once (a prompt) and a token at a time (a response) hold under 100 bytes a
    token (tracemalloc: allocations, not timing; about 20 measured, ``staleflow bench draft-index``;
    the dict of every n-gram held 1,300-1,500)."""
    rng = random.Random(0)
    tokens = [rng.randrange(vocab) for _ in range(20_000)]
    tracemalloc.start()
    try:
        whole = SuffixIndex(tokens)
        held_whole = tracemalloc.get_traced_memory()[0]
        grown = SuffixIndex()
        for token in tokens:
            grown.extend([token])
        held_both = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held_whole / len(tokens) < 100
    assert (held_both - held_whole) / len(tokens) < 100
    assert grown.continuation(tokens[-3:-1], len(tokens), 1) == whole.continuation(tokens[-3:-1], len(tokens), 1) == tokens[-1:]


def test_the_bench_prints_the_memory_and_step_figures_and_the_command(capsys) -> None:
    import json

    from staleflow.__main__ import main

    assert main(["bench", "draft-index", "--tokens", "2000", "--rows", "16", "--prompt", "50", "--warmup", "2", "--steps", "2",
                 "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [(row["vocab"], row["grown"]) for row in figures["memory"]] == [(50, False), (50, True), (32_000, False), (32_000, True)]
    assert all(row["tokens"] == 2000 and 0 < row["bytes_per_token"] <= row["peak_bytes_per_token"] for row in figures["memory"])
    assert set(figures["step"]) == {"record_ms", "draft_ms", "prompts_ms"} and figures["step"]["prompts_ms"] >= 0
    assert figures["command"].startswith("staleflow bench draft-index")
