"""MindSpore's ``Cell.recompute()`` under ``fully_shard``.

Its default (``use_reentrant=True``) wraps the cell's ``construct`` in a cell with a custom
bprop that runs the forward again under a nested grad of the cell's own ``trainable_params()``,
taken when ``recompute()`` was called. Inside a ``fully_shard`` unit the cells compute with the
gathered parameters the unit installs, which that nested grad treats as constants: the unit's
weights would get no gradient (and a cell marked before ``fully_shard`` holds the replaced full
Parameters). MindSpore's non-reentrant recompute (saved-tensor hooks) keeps autograd's own
graph, so the gradients go through the unit's gather as without recompute and the same
activations are recomputed: a reentrant ``Cell.recompute()`` inside a unit is switched to it.
"""
from __future__ import annotations

import logging

from mindspore.common.recompute import _RecomputeCell, recompute_generator

logger = logging.getLogger(__name__)


def non_reentrant_recompute(cell) -> bool:
    """Switch ``cell``'s reentrant ``recompute()`` to the non-reentrant one; True if it did."""
    # a reentrant recompute is a Cell, so Cell.__setattr__ keeps it among the child cells
    if not isinstance(cell._cells.get("_recompute_cell"), _RecomputeCell):   # pylint: disable=protected-access
        return False
    del cell._cells["_recompute_cell"]                                         # pylint: disable=protected-access
    object.__setattr__(cell, "_recompute_cell",
                       recompute_generator(cell.construct, use_reentrant=False))
    logger.info("fully_shard: %s.recompute() runs as MindSpore's non-reentrant recompute (a "
                "reentrant one would not differentiate the gathered parameters)",
                type(cell).__name__)
    return True
