"""What one record of a dataset costs in this node's Redis, estimated before a fill writes any.

A fill that stops only when ``used_memory`` reaches the budget overshoots it by every record already
decoded and in flight when it looks (a decode pool keeps several chunks of 16 in flight, and a master's
``used_memory`` moves only when they land), so both fills size themselves first: ``room // cost`` records,
the cost of a record measured from a few records already cached (their lengths through the server's
allocation model, :func:`datacache.plan.redis_bytes_per_key`), else the variant's nominal record.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datacache.plan import redis_bytes_per_key

SAMPLE = 8  # cached records read back per measurement


def sampled_record_bytes(reader: Any, store: Any, cached: np.ndarray,
                         rng: np.random.Generator) -> float | None:
    """Mean Redis cost of up to :data:`SAMPLE` of the records ``cached`` (dataset indices) holds, read back
    (a variant's records vary with the images' aspect ratios); None when none could be read."""
    if not len(cached):
        return None
    pick = np.asarray(cached)[rng.choice(len(cached), size=min(SAMPLE, len(cached)), replace=False)]
    values = store.get_many(reader.keys(pick.tolist()))
    sizes = [redis_bytes_per_key(len(v)) for v in values if v is not None]
    return float(np.mean(sizes)) if sizes else None


def nominal_record_bytes(variant: Any) -> float:
    """A 4:3 image at the variant's short side, through the same model (nothing cached to measure yet)."""
    s = variant.short_side
    return redis_bytes_per_key(s * min(variant.long_cap, s * 4 // 3) * 3 + 64)
