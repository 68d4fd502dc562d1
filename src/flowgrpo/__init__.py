"""flowgrpo: online reinforcement learning for flow-matching image generators (Flow-GRPO and family)."""

__version__ = "0.1.0"
