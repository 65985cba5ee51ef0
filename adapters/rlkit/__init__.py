"""The backend-neutral RL kit on torch tensors that the torch, FSDP and Megatron trainer bindings share: losses,
packing, the packed step, worker groups, Hugging Face folder I/O and weight buckets."""
