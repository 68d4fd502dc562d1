"""Evaluation: deterministic sampling with fixed seeds, rewards, and the paired change since the first one."""
