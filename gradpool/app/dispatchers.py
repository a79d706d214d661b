"""Which token dispatcher an expert-parallel run uses: one rule for the run
(:func:`gradpool.app.moe.dispatcher_for`) and for ``gradpool plan``, so the plan costs the
dispatcher the run will use. Pure Python: the config and the plan read it without MindSpore."""
from __future__ import annotations

from gradpool.errors import InvalidArgumentError

# The token dispatchers, by the names config (model.moe_dispatcher) and `gradpool plan` use.
DISPATCHERS = ("all-to-all", "all-gather")
AUTO = "auto"


def resolve_dispatcher(choice: str, device: str) -> str:
    """The dispatcher a run with ``model.moe_dispatcher = choice`` uses on ``device`` (and the
    one its plan costs): ``auto`` is the all-to-all on Ascend, where each routed row crosses the
    network once (``k N`` rows per rank and layer, against ``E N`` gathered and ``E N``
    reduce-scattered for the all-gather one), and the all-gather one elsewhere, whose
    collectives CPU has natively (the all-to-all runs on CPU through a stand-in that moves E
    times its bytes)."""
    if choice == AUTO:
        return "all-to-all" if device == "Ascend" else "all-gather"
    if choice not in DISPATCHERS:
        raise InvalidArgumentError(f"token dispatcher {choice!r}: use {AUTO!r} or one of "
                                   f"{', '.join(map(repr, DISPATCHERS))}")
    return choice
