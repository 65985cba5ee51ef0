"""A vLLM proposer that drafts from a request's siblings: the other responses of its prompt.

vLLM 0.32 loads a proposer of one's own with ``speculative_config={"method": "custom_class", "model":
"<module>.<Class>"}`` (``vllm/v1/spec_decode/custom_class_proposer.py``): it builds the class with the
``VllmConfig`` only and, after every step, calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu)`` with the batch's rows (``vllm/v1/worker/gpu_model_runner.py``,
``propose_draft_token_ids``; the CPU model runner is a subclass of that one, so vLLM-CPU runs it too).
No request id or prompt length reaches it, so :class:`~staleflow.runtime.drafts.SiblingDrafts`
recognises rows and groups by their tokens. The target model verifies every draft by rejection
sampling, so what is sampled is what the model without speculation samples, whatever the drafts.

Unlike vLLM's own proposers this one is not told how many tokens the scheduler will take this step
(``num_speculative_tokens_per_batch_size``): it reads the schedule from the config and looks up the
batch's size itself, as the scheduler does.
"""

from __future__ import annotations

from typing import Any

from staleflow.runtime.drafts import SiblingDrafts


class _Row:
    """Row ``i`` of vLLM's token array up to its length, read as a sequence (slices become lists)."""

    def __init__(self, tokens: Any, length: int) -> None:
        self._tokens, self._length = tokens, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, part: slice) -> list[int]:
        start, stop, _ = part.indices(self._length)
        return self._tokens[start:stop].tolist()


class SiblingProposer:
    """vLLM's ``custom_class`` proposer over :class:`~staleflow.runtime.drafts.SiblingDrafts` (module
    docstring). ``drafts`` keeps its counts of draft tokens proposed and of those from a sibling."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        spec = vllm_config.speculative_config
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self._k = spec.num_speculative_tokens
        self._max_model_len = vllm_config.model_config.max_model_len
        self._schedule = (
            build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, max_num_seqs, self._k)
            if spec.num_speculative_tokens_per_batch_size else None
        )
        # a step vLLM drafts nothing for (a row near the model's length) is not seen: two steps' tokens
        self.drafts = SiblingDrafts(lookback=2 * (self._k + 1), capacity=4 * max_num_seqs)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None) -> list[list[int]]:
        """Drafts for each row of the batch (empty for a row that sampled nothing: still in prefill)."""
        batch = len(sampled_token_ids)
        k = self._k if self._schedule is None else self._schedule[min(batch, len(self._schedule) - 1)]
        lengths = [int(num_tokens_no_spec[i]) for i in range(batch)]
        rows = [_Row(token_ids_cpu[i], lengths[i]) if sampled else None for i, sampled in enumerate(sampled_token_ids)]
        drafts = self.drafts.propose(rows, k)
        return [draft[: max(0, self._max_model_len - length)] for draft, length in zip(drafts, lengths, strict=True)]

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model to load (vLLM's model runners call this on every proposer)."""
