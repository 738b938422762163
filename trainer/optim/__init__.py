"""Layer-wise adaptive optimizers (LARS, LAMB) with optional PTO trust-ratio sharding."""

from trainer.optim.lamb import LAMB
from trainer.optim.lars import LARS
from trainer.optim.pto import COLLECTIVE_CHOICES, PTO, ShardPlan, balanced_assignment, make_plan

__all__ = ["COLLECTIVE_CHOICES", "LAMB", "LARS", "PTO", "ShardPlan", "balanced_assignment", "make_plan"]
