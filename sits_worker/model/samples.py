"""Sample rows for a model's signature: what profiles and tuning sweeps run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

PROFILE_SEQUENCE = 128
"""The sequence length of a token model's sample rows."""
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64,
                 "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}


def sample_feed(signature: Mapping[str, Any], batch: int, sequence: int = PROFILE_SEQUENCE,
                seed: int = 0) -> dict[str, np.ndarray]:
    """A deterministic random feed of `batch` rows for a signature (token ids stay small)."""
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    for spec in signature["inputs"]:
        dims = [batch] + [d if isinstance(d, int) else sequence for d in spec["shape"][1:]]
        dtype = _NUMPY_DTYPES.get(spec["dtype"], np.float32)
        if np.issubdtype(dtype, np.integer):
            feed[spec["name"]] = rng.integers(0, 100, size=dims).astype(dtype)
        else:
            feed[spec["name"]] = rng.standard_normal(dims).astype(dtype)
    return feed
