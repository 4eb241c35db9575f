"""Sharded state (FSDP2): local shards and their shard map in the memory tier, resharding from peers' memory
when the world size changes, and durable checkpoints in torch.distributed.checkpoint's format."""
