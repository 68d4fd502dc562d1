"""The rollout engine (`RolloutEngine`): encoding, sampling with the SDE scheduler through the algorithm's
`RolloutStrategy`, decoding, rewards and group advantages."""

from .engine import RolloutEngine
from .generation import Generation
from .strategies import FinalSampleRollout, RolloutStrategy

__all__ = ["FinalSampleRollout", "Generation", "RolloutEngine", "RolloutStrategy"]
