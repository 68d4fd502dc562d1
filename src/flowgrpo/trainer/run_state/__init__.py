"""Run state: atomic checkpoints and resume, crash safety, preemption, the non-finite step guard, EMA weights and
the old (sampling) policy."""
