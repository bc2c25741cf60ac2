"""Settings read from the environment, with errors that name the variable."""

from __future__ import annotations

import os


def int_setting(name: str, unit: str, minimum: int) -> int | None:
    """The int in ``name``, at least ``minimum`` (None when unset or blank);
    a ValueError naming the variable and the unit when it is anything else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}: must be {rule} ({unit}), got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: must be {rule} ({unit}), got {value}")
    return value


def positive_int(name: str, unit: str) -> int | None:
    """``int_setting`` of at least 1."""
    return int_setting(name, unit, 1)
