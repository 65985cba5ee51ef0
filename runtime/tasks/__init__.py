"""Tasks: prompts and verifiable rewards.

- :mod:`~staleflow.runtime.tasks.builtin`: the built-in tasks ("repeat the letter"; generated
  arithmetic word problems in verl's row format) and the :class:`Prompt` record;
- :mod:`~staleflow.runtime.tasks.data`: prompt files (JSON lines, Parquet; dotted keys, chat
  messages, the prompt-length policy, errors that name the file, line and key), prompt streams and
  GRPO groups;
- :mod:`~staleflow.runtime.tasks.rewards`: the built-in scorers (``exact_match``, ``repeat_letter``,
  ``gsm8k``, ``math``) and users' ``module:function`` scorers, called as
  ``score(prompt, response, answer, metadata) -> float``.

The runtime runs rewards in worker processes under a timeout (``runtime/run/rewarding.py``).
"""

from staleflow.runtime.tasks.builtin import (
    Prompt,
    arithmetic_problem,
    arithmetic_rows,
    repeat_letter_count,
    repeat_letter_prompt,
    repeat_letter_prompts,
)
from staleflow.runtime.tasks.data import (
    ChatRenderer,
    PromptFile,
    PromptFileError,
    cycle_prompts,
    load_prompts,
    lookup,
    make_group,
    plain_render,
    read_prompt_file,
)
from staleflow.runtime.tasks.rewards import (
    BUILTIN_REWARDS,
    RewardFn,
    RewardSpecError,
    Scorer,
    ScorerResultError,
    check_reward_spec,
    exact_match_reward,
    gsm8k_final_answer,
    gsm8k_reward,
    is_reward_spec,
    math_reward,
    repeat_letter_reward,
    resolve_scorer,
    score_items,
)

__all__ = [
    "BUILTIN_REWARDS", "ChatRenderer", "Prompt", "PromptFile", "PromptFileError", "RewardFn", "RewardSpecError",
    "Scorer", "ScorerResultError", "arithmetic_problem", "arithmetic_rows", "check_reward_spec", "cycle_prompts",
    "exact_match_reward", "gsm8k_final_answer", "gsm8k_reward", "is_reward_spec", "load_prompts", "lookup", "make_group",
    "math_reward", "plain_render", "read_prompt_file", "repeat_letter_count", "repeat_letter_prompt", "repeat_letter_prompts",
    "repeat_letter_reward", "resolve_scorer", "score_items",
]
