"""Settings read from the environment, with errors that name the variable."""

from __future__ import annotations

import os


def positive_int(name: str, unit: str) -> int | None:
    """The positive int in ``name`` (None when unset or blank); a ValueError
    naming the variable and the unit when it is anything else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}: must be a positive int ({unit}), got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: must be a positive int ({unit}), got {value}")
    return value
