"""The requests of a failed step, each run alone from then on until it finishes (the
scheduler's failure containment: `Scheduler.fail_step`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from vlmserve.request import Request


class Suspects:
    """Ids of the requests that were in a failed step with others. Suspects get every other
    step while others have work, one suspect alone (a running one first: it holds KV)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self._turn = False  # flips each step while there are suspects

    def __bool__(self) -> bool:
        return bool(self.ids)

    def eligibility(self, running: Iterable[Request], waiting: Iterable[Request]
                    ) -> Callable[[Request], bool]:
        """Which requests the next step may schedule: everyone (no suspects), one suspect
        alone, or everyone but the suspects."""
        if not self.ids:
            return lambda r: True
        self._turn = not self._turn
        queue = list(itertools.chain(running, waiting))
        if not self._turn and any(r.request_id not in self.ids for r in queue):
            return lambda r: r.request_id not in self.ids
        suspect = next(r for r in queue if r.request_id in self.ids)
        return lambda r: r is suspect
