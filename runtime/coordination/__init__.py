"""The rollout coordinator: snapshots in, commands out, with its routing, sync and migration strategies and the
cost model they share."""
