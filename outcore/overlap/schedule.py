"""When groups are fetched and released: a traced prefetch schedule within one byte budget.

[Note: trace, follow, re-trace]
The first iteration (one forward and its backward) records the order in which groups are
needed. Later iterations follow that trace with a cursor: each time a group is needed, the
schedule finds it a short way ahead of the cursor (groups skipped over were already there,
e.g. kept from forward into backward), moves the cursor past it, and starts fetching the
next groups of the trace while their full size fits ``zero.prefetch_bytes``. A group not
found ahead is a *divergence* (a module skipped, an MoE expert chosen differently, eval
instead of train): it is counted, the group is fetched on demand, prefetching stops for the
rest of the iteration, and the order actually seen becomes the trace for the next one.
Divergence therefore costs some overlap, never correctness, and is never printed per step.

[Note: carrying the head across iterations]
Backward ends with the groups the next forward begins with (the embedding, the first
blocks). With ``carry`` on, the trace is read as a cycle when deciding what to keep: a group
that the next iteration's head needs within the budget is kept when backward finishes with
it, and stays gathered through the step instead of being released and read back from disk
right after. This is only sound where the gathered values can be brought up to date without
the disk: at one rank, with the fp32 masters in memory, the step refreshes a kept group's
full tensors from its masters (``GatherGroup.refresh_after_step``). Elsewhere the step
releases them, as before. Prefetching never reads across the cycle: reads issued before a
step would fetch values the step is about to change.

[Note: why the all-gather is never prefetched]
Prefetching issues only the *local* stages of a fetch: reading shards from NVMe into host
memory (and, on CUDA, copying them to the device). The all-gather runs when the group is
actually needed, i.e. in program order, which is the same on every rank. A collective issued
from a trace could pair with a different collective on a rank whose control flow went
elsewhere, which is how prefetching hangs or silently mixes up tensors in other systems.
With one rank per machine the all-gather is cheap next to the disk; the disk is what the
schedule hides.

[Note: the budget is for bytes fetched ahead, and it is a hard cap]
``prefetch_bytes`` bounds the full size of groups fetched or kept ahead of use and not held
by a running module. A group larger than the whole budget is fetched on demand (a warning
says so once). So the memory the schedule adds is at most the budget, whatever the model.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterator
from enum import Enum

from outcore.zero.group import GatherGroup
from outcore.zero.state import GroupState

log = logging.getLogger("outcore")

LOOKAHEAD = 16  # trace entries searched for a needed group before calling it a divergence


class Mode(str, Enum):
    """What the schedule does with the order groups are needed in (see [Note: trace, follow,
    re-trace])."""

    TRACING = "tracing"  # no trace yet: record the order, fetch on demand
    FOLLOWING = "following"  # follow the trace with a cursor and prefetch along it
    DIVERGED = "diverged"  # left the trace this iteration: fetch on demand, record anew


class Schedule:
    """Fetch and release groups; prefetch along the recorded trace; count what happened."""

    def __init__(self, prefetch_bytes: int, groups: list[GatherGroup] | None = None,
                 carry: bool = False, resident_bytes: int = 0) -> None:
        self.prefetch_bytes = prefetch_bytes
        # training copies kept in host memory across steps, out of the budget (build.py's
        # keep_resident); not the zero-copy groups of params that live in host memory anyway
        self.resident_bytes = resident_bytes
        self.groups = groups or []
        self.mode = Mode.TRACING
        self.trace: list[int] | None = None
        self.recording: list[int] = []
        self.cursor = 0
        self.ahead: dict[int, int] = {}  # group index -> full bytes fetched ahead of use
        self.peak_ahead_bytes = 0
        # with nothing ever released (one rank, states resident) there is nothing to prefetch
        self.movable = any(not g.zero_copy for g in self.groups)
        self._started_early = False  # see [Note: prefetch across the step]
        self.carry = carry  # see [Note: carrying the head across iterations]
        self._carried: set[int] = set()  # carried groups not yet used by this iteration
        self._warned_small_budget = False
        self._warned_divergence = False
        self.counts = {"fetches": 0, "on_demand_fetches": 0, "prefetches": 0,
                       "prefetch_hits": 0, "kept": 0, "releases": 0, "divergences": 0,
                       "retraces": 0, "iterations": 0, "carried": 0, "displaced": 0}

    # -- iteration boundaries ------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """A new forward starts: adopt a new trace if the last one diverged (or none exists)."""
        if self.recording:
            if self.mode is not Mode.FOLLOWING:
                if self.mode is Mode.DIVERGED:
                    self.counts["retraces"] += 1
                self.trace = self.recording
            self.counts["iterations"] += 1
        self.recording = []
        self.cursor = 0
        self.mode = Mode.TRACING if self.trace is None else Mode.FOLLOWING

    def begin_forward(self) -> None:
        """A forward starts (not a recomputation inside backward): end the last iteration and
        begin the next, unless the step already did (see [Note: prefetch across the step])."""
        if not self._started_early:
            self.end_iteration(carry=True)
            self.begin_iteration()
        self._started_early = False

    def start_next_iteration(self) -> None:
        """The optimizer step is done: begin the next iteration now and start reading the
        head of its trace, so the next forward finds its first groups on the way.

        [Note: prefetch across the step]
        A forward begins with the groups the previous step updated last (backward runs in
        reverse), so it would otherwise start with a queue of on-demand reads. Issuing them
        when the step ends overlaps them with whatever the user does between step and
        forward (logging, loading the next batch) and puts the disk to work at once. The
        reads are local stages only, like any prefetch; if the next forward takes another
        path, it diverges as usual and the unused reads are cancelled.
        """
        self.end_iteration(carry=True)
        self.begin_iteration()
        self._prefetch()
        self._started_early = True

    def end_iteration(self, carry: bool = False) -> None:
        """An iteration is over: drop everything fetched or kept ahead that was not used,
        except, with ``carry``, what the next iteration's head needs (see the note)."""
        self._started_early = False
        keep = self._next_head() if carry and self.carry else set()
        self.ahead.clear()
        self._carried.clear()
        for g in self.groups:
            if g.holds == 0 and not g.persistent and g.state is not GroupState.SHARDED:
                if g.index in keep:
                    self.ahead[g.index] = g.full_bytes
                    self._carried.add(g.index)
                    continue
                g.reshard()
                self.counts["releases"] += 1
        self.peak_ahead_bytes = max(self.peak_ahead_bytes, self._ahead_bytes())

    def _next_head(self) -> set[int]:
        """Indices of the groups that start the next iteration, within the budget."""
        trace = self.trace if self.mode is Mode.FOLLOWING else self.recording
        assert trace is not None  # FOLLOWING only with a trace (begin_iteration)
        head: set[int] = set()
        budget = self.prefetch_bytes
        for index in trace:
            g = self.groups[index]
            if g.persistent or index in head:
                continue
            budget -= g.full_bytes
            if budget < 0:
                break
            head.add(index)
        return head

    @property
    def updating(self) -> bool:
        """Whether a zero-copy group, which keeps showing its shards, has updates from the
        step not yet waited for (group.py's ``refresh_after_step``; a failed one stays): a
        forward then checks each parameter it reads, as it does where groups are released,
        so a read outside its module's call waits, or raises the update's error, too."""
        return any(g.zero_copy and g.awaits_update for g in self.groups)

    def await_updates(self) -> None:
        """Wait for the updates of every zero-copy group (raising the first error): for a
        submodule called on its own, which may read weights of modules it does not call
        where no access mode sees them."""
        for g in self.groups:
            if g.zero_copy and g.awaits_update:
                g.await_update()

    # -- the three calls the hooks make --------------------------------------------------------
    def need(self, groups: list[GatherGroup], on_demand: bool = False) -> None:
        """Make ``groups`` unsharded before returning, then prefetch along the trace."""
        for g in groups:
            self._follow(g)
            if g.index in self._carried:  # used by the iteration it was carried into
                self._carried.discard(g.index)
                self.counts["carried"] += 1
            if g.state is GroupState.FETCHING and g.index in self.ahead:
                self.counts["prefetch_hits"] += 1
            elif g.state is not GroupState.UNSHARDED:
                self.counts["on_demand_fetches" if on_demand else "fetches"] += 1
            self.ahead.pop(g.index, None)
            g.unshard()
        for g in groups:
            g.wait_unshard()
        self._prefetch()

    def done(self, group: GatherGroup) -> None:
        """The current user of ``group`` is finished with it: release it, or keep it if the
        trace needs it again within the budget."""
        if group.persistent or group.state is GroupState.SHARDED:
            return
        if self._needed_soon(group) or self._make_room(group):
            self.ahead[group.index] = group.full_bytes
            self.peak_ahead_bytes = max(self.peak_ahead_bytes, self._ahead_bytes())
            self.counts["kept"] += 1
            return
        self.ahead.pop(group.index, None)
        group.reshard()
        self.counts["releases"] += 1

    def stats(self) -> dict[str, int]:
        out = dict(self.counts)
        out["peak_ahead_bytes"] = self.peak_ahead_bytes
        out["ahead_bytes"] = self._ahead_bytes()  # now: fetched or kept ahead, in memory
        out["prefetch_bytes"] = self.prefetch_bytes
        out["resident_bytes"] = self.resident_bytes
        out["trace_length"] = len(self.trace or [])
        return out

    # -- following the trace -------------------------------------------------------------------
    def _follow(self, g: GatherGroup) -> None:
        self.recording.append(g.index)
        if self.mode is not Mode.FOLLOWING:
            return
        assert self.trace is not None  # FOLLOWING only with a trace (begin_iteration)
        window = self.trace[self.cursor : self.cursor + LOOKAHEAD]
        if g.index in window:
            self.cursor += window.index(g.index) + 1
            return
        self.mode = Mode.DIVERGED
        self.counts["divergences"] += 1
        if not self._warned_divergence:
            self._warned_divergence = True
            log.info("outcore: execution order differs from the recorded trace (group %s); "
                     "fetching on demand and re-tracing. Later divergences are only counted "
                     "(engine.schedule_stats()).", g.name)

    def _upcoming(self, cycle: bool = False) -> Iterator[GatherGroup]:
        """Groups in the order the trace will need them; with ``cycle``, followed by the next
        iteration's (see [Note: carrying the head across iterations])."""
        if self.mode is not Mode.FOLLOWING or not self.movable:
            return
        assert self.trace is not None  # FOLLOWING only with a trace (begin_iteration)
        seen: set[int] = set()
        rest = itertools.islice(self.trace, self.cursor, None)  # no copy: called per release
        for index in itertools.chain(rest, self.trace) if cycle else rest:
            if index not in seen:
                seen.add(index)
                yield self.groups[index]

    def _ahead_bytes(self) -> int:
        """Bytes fetched or kept ahead that are still in memory: a group released behind the
        schedule's back (``gathered_parameters``, a weight load) no longer counts."""
        return sum(nbytes for index, nbytes in self.ahead.items()
                   if self.groups[index].state is not GroupState.SHARDED)

    def _needed_soon(self, group: GatherGroup) -> bool:
        budget = self.prefetch_bytes - self._ahead_bytes()
        for g in self._upcoming(cycle=self.carry):
            if g is group:
                return group.full_bytes <= budget
            if not g.persistent and g.state is GroupState.SHARDED:
                budget -= g.full_bytes
            if budget < 0:
                return False
        return False

    def _make_room(self, group: GatherGroup) -> bool:
        """Keep ``group`` by releasing kept groups the trace needs after it, if that is enough.

        [Note: the budget goes to what is needed first]
        Keeping is decided when a group is released, and prefetching when a group is needed,
        so the budget fills in the order groups happen to be released, not in the order they
        will be needed. A tied embedding shows the cost: at the end of backward the first
        blocks were already kept for the next forward, so the embedding, which that forward
        needs first, was released and read back from disk at once, with the forward waiting.
        Here a group that comes before others in the trace may take their place: kept groups
        needed later (or not at all) are released, latest first, while the budget, filled
        in trace order, still has room for ``group``. Only groups whose reads are complete
        are released this way; cancelling one still being read would wait for the read.
        Prefetching leaves room the same way (``_prefetch`` counts held groups the trace needs
        before its candidates), so this is the exception, not the rule.
        """
        upcoming = self._upcoming(cycle=self.carry)
        before: set[int] = set()
        filled = group.full_bytes  # the budget, filled in trace order up to ``group``
        for g in upcoming:
            if g is group:
                break
            before.add(g.index)
            if not g.persistent:
                filled += g.full_bytes
                if filled > self.prefetch_bytes:
                    return False
        else:
            return False  # not needed again in the window the schedule can see
        free = self.prefetch_bytes - self._ahead_bytes() - group.full_bytes
        if free >= 0:
            return True
        movable = [i for i in self.ahead
                   if i not in before and i != group.index
                   and self.groups[i].state is GroupState.UNSHARDED and self.groups[i].holds == 0]
        if free + sum(self.ahead[i] for i in movable) < 0:
            return False  # not enough even without them: release nothing for nothing
        # the rest of the trace is walked only now, when something will be released
        after = {g.index: n for n, g in enumerate(upcoming)}  # the generator goes on from here
        later = sorted(movable, key=lambda i: -after.get(i, len(after)))
        for index in later:
            if free >= 0:
                break
            free += self.ahead.pop(index)
            self._carried.discard(index)  # read again when used: not carried any more
            self.groups[index].reshard()
            self.counts["releases"] += 1
            self.counts["displaced"] += 1
        return True  # the check above guaranteed the room

    def _prefetch(self) -> None:
        if self.prefetch_bytes <= 0:
            return
        used = self._ahead_bytes()
        for g in self._upcoming():
            if g.persistent:
                continue
            if g.state is not GroupState.SHARDED:
                if g.holds > 0 and g.index not in self.ahead and (
                        g.full_bytes <= self.prefetch_bytes):
                    # held now and needed again before what follows: it will be kept when
                    # released, so leave it its room (see [Note: the budget goes to ...])
                    used += g.full_bytes
                continue
            if g.full_bytes > self.prefetch_bytes:
                self._warn_small_budget(g)
                return
            if used + g.full_bytes > self.prefetch_bytes or g.updating:
                return  # (an update still writing its shards: read them when it is done)
            g.unshard()
            self.ahead[g.index] = g.full_bytes
            used += g.full_bytes
            self.counts["prefetches"] += 1
            self.peak_ahead_bytes = max(self.peak_ahead_bytes, used)

    def _warn_small_budget(self, g: GatherGroup) -> None:
        if not self._warned_small_budget:
            self._warned_small_budget = True
            warnings.warn(
                f"zero.prefetch_bytes={self.prefetch_bytes} is smaller than group '{g.name}' "
                f"({g.full_bytes} bytes); such groups are fetched on demand", stacklevel=3)
