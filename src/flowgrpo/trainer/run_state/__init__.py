"""Run state: atomic checkpoints and resume, crash safety's pieces, preemption, the non-finite step guard."""
