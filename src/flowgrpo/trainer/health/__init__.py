"""Reward hacking and collapse: gold evaluation rewards, diagnostics (``health/...``), alarms and guards.

Modules: `arguments` (the configuration fields), `metrics` (diversity, zero-std groups, reward correlations, KL to
the reference, update ratio), `alarms` (hacking and diversity alarms), `gardo` (GARDO's gate, gate fraction,
reference resets and diversity-aware advantages), `dynamic_sampling` (DAPO's refill bookkeeping),
`monitor` (the run-long state saved in checkpoints) and `guards` (`HealthGuards`, the trainer's part that uses them
all, called through explicit hooks). docs/learning_health.md states every formula. The reference policy and its
refresh are the policy's (`flowgrpo.trainer.policy.reference`).
"""

from .alarms import DiversityAlarm, HackingAlarm, HackingVerdict
from .arguments import HealthArguments, check_health_arguments
from .monitor import HEALTH_STATE_NAME, HealthMonitor

__all__ = ["HEALTH_STATE_NAME", "DiversityAlarm", "HackingAlarm", "HackingVerdict", "HealthArguments", "HealthGuards",
           "HealthMonitor", "check_health_arguments"]


def __getattr__(name: str):
    # The guards need the rollout engine (torch, diffusers); the configuration imports this package's light parts
    # only, so the guards load on first use.
    if name == "HealthGuards":
        from .guards import HealthGuards

        return HealthGuards
    raise AttributeError(f"module 'flowgrpo.trainer.health' has no attribute {name!r}")
