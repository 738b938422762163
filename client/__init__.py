"""Training-side read path: CachedImageNet, batched fetch, batched augmentation."""
