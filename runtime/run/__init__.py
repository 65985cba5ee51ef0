"""The run loop and its duties: assembling a run, the one owner of a group's life, rewards, instance driving and
health, weight publication, clocks, checkpoints and run figures."""
