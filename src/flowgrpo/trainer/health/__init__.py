"""Reward hacking and collapse: gold evaluation rewards, diagnostics (``health/...``), alarms and guards.

Modules: `arguments` (the configuration fields), `metrics` (diversity, zero-std groups, reward correlations, KL to
the reference, update ratio), `alarms` (hacking and diversity alarms), `gardo` (GARDO's gate, gate fraction,
reference resets and diversity-aware advantages), `dynamic_sampling` (DAPO's refill bookkeeping), `reference` (the
reference policy and its refresh), `monitor` (the run-long state saved in checkpoints). docs/learning_health.md
states every formula.
"""

from .alarms import DiversityAlarm, HackingAlarm, HackingVerdict
from .arguments import HealthArguments, check_health_arguments
from .monitor import HEALTH_STATE_NAME, HealthMonitor
from .reference import REFERENCE_ADAPTER, ReferencePolicy, ReferenceSyncCallback

__all__ = ["HEALTH_STATE_NAME", "REFERENCE_ADAPTER", "DiversityAlarm", "HackingAlarm", "HackingVerdict",
           "HealthArguments", "HealthMonitor", "ReferencePolicy", "ReferenceSyncCallback", "check_health_arguments"]
