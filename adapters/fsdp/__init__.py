"""The FSDP2 trainer binding (torch.distributed ``fully_shard``), ranks in spawned processes or Ray actors."""
