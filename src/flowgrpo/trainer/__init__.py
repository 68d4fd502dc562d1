from .config import FlowGRPOConfig
from .flow_grpo_trainer import FlowGRPOTrainer

__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer"]
