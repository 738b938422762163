"""Training-side stack: the training CLI (``python -m trainer`` / ``datacache-train``: cli,
train_config, build, run, loop, data, device_augment, prefetch, checkpoint), models,
sparse/hierarchical gradient communication (comm/) and optimizers (optim/)."""
