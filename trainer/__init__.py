"""Training-side stack: sparse/hierarchical gradient communication (comm/) and optimizers (optim/)."""
