"""The trained policy and its copies (`Policy`): loading, the LoRA or full weights, the reference policy, the old
policy, the EMA, their velocities, saving and loading."""

from .ema import EMA_STATE_NAME, EMAWeights
from .old_policy import OLD_POLICY_ADAPTER, OLD_POLICY_WEIGHTS_NAME, OldPolicy, old_policy_decay
from .policy import Policy
from .reference import REFERENCE_ADAPTER, REFERENCE_WEIGHTS_NAME, ReferencePolicy, ReferenceSyncCallback

__all__ = ["EMA_STATE_NAME", "OLD_POLICY_ADAPTER", "OLD_POLICY_WEIGHTS_NAME", "REFERENCE_ADAPTER",
           "REFERENCE_WEIGHTS_NAME", "EMAWeights", "OldPolicy", "Policy", "ReferencePolicy", "ReferenceSyncCallback",
           "old_policy_decay"]
