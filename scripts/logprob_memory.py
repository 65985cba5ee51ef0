"""Peak memory of one forward + backward of next-token log-probs: padded full-vocabulary vs chunked.

    python scripts/logprob_memory.py padded 2048     # the full [tokens, vocabulary] log-softmax
    python scripts/logprob_memory.py 1024 2048       # chunked_logprobs with chunk 1024

A 1-layer, hidden-64 Qwen2 with Qwen2.5's 151,936-token vocabulary (tied), so the output layer
dominates; prints the growth of the process's peak RSS. Run each mode in a fresh process.
"""

import resource
import sys
import time

import torch
from staleflow.adapters.rlkit.algorithms import token_logprobs
from staleflow.adapters.rlkit.packing import LogProbModel
from transformers import Qwen2Config, Qwen2ForCausalLM

mode, tokens = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
config = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, tie_word_embeddings=True)
model = Qwen2ForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (1, tokens))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.time()
if mode == "padded":
    logp = token_logprobs(model(input_ids=ids).logits, ids)
else:
    logp = LogProbModel(model, chunk=int(mode))(ids, torch.arange(tokens)[None], torch.roll(ids[0], -1))
logp.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{mode:>7}: {tokens} tokens, peak RSS growth {(peak - base) / 1024:.0f} MiB ({time.time() - began:.1f} s)")
