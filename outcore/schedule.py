"""When groups are fetched and released.

This is the on-demand schedule: a group is fetched when first needed and released when its
user is done with it. The traced prefetch schedule (fetch the next groups of the recorded
order within ``zero.prefetch_bytes``) plugs in behind the same three calls.
"""

from __future__ import annotations

from outcore.group import ParamGroup


class Schedule:
    """On-demand fetch and release; counts what it did for ``schedule_stats()``."""

    def __init__(self, prefetch_bytes: int) -> None:
        self.prefetch_bytes = prefetch_bytes
        self.pass_kind = "forward"
        self.counts = {"fetches": 0, "on_demand_fetches": 0, "releases": 0}

    def begin_pass(self, kind: str) -> None:
        self.pass_kind = kind

    def need(self, groups: list[ParamGroup], on_demand: bool = False) -> None:
        """Make ``groups`` unsharded before returning (issue all fetches, then wait)."""
        for g in groups:
            g.unshard()
        for g in groups:
            if g.state.value != "unsharded":
                self.counts["on_demand_fetches" if on_demand else "fetches"] += 1
            g.wait_unshard()

    def done(self, group: ParamGroup) -> None:
        """The current user of ``group`` is finished with it."""
        if not group.persistent and group.state.value != "sharded":
            group.reshard()
            self.counts["releases"] += 1

    def stats(self) -> dict[str, int]:
        return dict(self.counts)
