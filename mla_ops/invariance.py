"""The batch-invariant mode: whether each sequence's output and LSE must be bitwise the same in any batch.

The setting (``MLA_OPS_BATCH_INVARIANT``, or :func:`mla_ops.selector.set_batch_invariant` and the
``mla_ops.batch_invariant()`` context manager, which win over it) lives here, in a module that imports
nothing of the package but the leaf :mod:`mla_ops.switches`, so that the selector and the backends both read
it. :data:`STATE` holds it; the selector resolves it when it routes a configuration (:func:`resolve`) and
clears it with its caches, so a backend reads a plain attribute on every call. Design:
docs/design/backends.md (Batch invariance).
"""

from __future__ import annotations

import os

from .switches import parse_switch

#: Environment variable: ``1`` turns the batch-invariant mode on, ``0`` (or unset) leaves it off.
ENV_VAR = "MLA_OPS_BATCH_INVARIANT"


class State:
    """``forced``: the Python API's setting (``None``: the environment decides); ``active``: the mode as last
    resolved by :func:`resolve` (what backends read per call)."""

    def __init__(self) -> None:
        self.forced: bool | None = None
        self.active = False


#: This process's setting.
STATE = State()


def env_setting() -> bool:
    """``MLA_OPS_BATCH_INVARIANT`` as a bool; raises ``ValueError`` naming the variable for a value other than
    ``0``, ``1`` or empty (``true`` or ``yes`` would otherwise leave it off without a word)."""
    return parse_switch(ENV_VAR, os.environ.get(ENV_VAR, ""), default=False)


def resolve() -> bool:
    """Whether the mode is on (the API's setting, else the environment's), remembered in ``STATE.active``;
    raises ``ValueError`` for an invalid ``MLA_OPS_BATCH_INVARIANT``."""
    STATE.active = STATE.forced if STATE.forced is not None else env_setting()
    return STATE.active
