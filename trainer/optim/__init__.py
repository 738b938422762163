"""Layer-wise adaptive optimizers (LARS, LAMB) with optional PTO trust-ratio sharding."""
