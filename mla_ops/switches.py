"""The one rule of the package's on/off environment settings: ``0`` or ``1``, or empty for the default.

Every such variable (``MLA_OPS_BATCH_INVARIANT``, ``MLA_OPS_NATIVE``, ``MLA_OPS_NATIVE_LAUNCH``) is read
through :func:`parse_switch`, so that each accepts the same text and refuses the rest with the same message:
``true`` or ``no`` would otherwise be read as the default without a word. It imports nothing of the package,
so that the modules reading those variables (:mod:`mla_ops.invariance`, :mod:`mla_ops.native`) stay leaves.
"""

from __future__ import annotations


def parse_switch(name: str, value: str, *, default: bool) -> bool:
    """The on/off setting ``name`` whose text is ``value``: ``1`` on, ``0`` off, empty or blank ``default``;
    raises ``ValueError`` naming the variable and which of the two is its default for any other text."""
    text = value.strip()
    if not text:
        return default
    if text in ("0", "1"):
        return text == "1"
    off, on = ("off", "on, the default") if default else ("off, the default", "on")
    raise ValueError(f"{name} must be 0 ({off}) or 1 ({on}), got {text!r}")
