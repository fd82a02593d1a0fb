"""Collaborative training: the trainer (accumulate, group, all-reduce, step), its state, state transfer for
joiners, checkpoints and export. What is trained, the workloads, lives in :mod:`peerd.tasks`."""
