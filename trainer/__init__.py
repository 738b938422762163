"""Training-side stack: the training CLI (``python -m trainer`` / ``datacache-train``: cli, config, run,
loop, data, device_augment, prefetch, checkpoint), models, sparse/hierarchical gradient
communication (comm/) and optimizers (optim/)."""
