"""The backend-neutral RL kit on torch tensors that the torch, FSDP and Megatron trainer bindings share: losses
(``algorithms``), packing and the packed step, trainer settings, checkpoint files, the Hugging Face causal LM and
its folders, the background step thread, worker groups and weight buckets. It imports no binding of ours."""
