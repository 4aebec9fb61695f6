"""Preemption: SIGTERM (and Ctrl-C) become a stop at a step boundary that every rank agrees on.

```python
with outcore.preemption() as stop, outcore.initialize(model, cfg) as engine:
    for batch in loader:
        engine.backward(engine(**batch))
        engine.step()
        if stop.stop_requested(engine):        # a collective: every rank, every step
            engine.save_checkpoint(folder)
            break
sys.exit(stop.exit_code)                       # 75 after SIGTERM, 130 after Ctrl-C, else 0
```

[Note: a signal is a request, answered at the step boundary]
Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM, wait a grace period, then send
SIGKILL. A process that dies on the SIGTERM loses every step since its last checkpoint, and
one that stops inside a step has nothing consistent to save: gradients half reduced, updates
half applied. So the handler only records the signal, and the loop asks at its step
boundary, where the engine's state is exactly "after step s", and saves there.
- One answer for all ranks. A signal may reach one rank only (one node drained, one pod
  evicted) or all of them at slightly different moments. ``stop_requested(engine)``
  all-reduces the highest signal number received (MAX) over the engine's comm, so every rank
  gets the same answer, and the same signal, at the same step; a rank that stopped alone would
  leave the others waiting in their next collective until ``comm.timeout_s``. Once it has said
  yes it says yes without another collective, which every rank knows to skip. The highest
  number, not the first to arrive: SIGTERM (15) outranks Ctrl-C (2), so a job that was
  preempted exits as preempted, and the kernel delivers signals pending together lowest first.
- The save is allowed to complete. Once the stop is agreed, every further signal this context
  handles is counted and otherwise ignored until the context exits (after the save and
  ``engine.close()``). Some schedulers signal every process of a job, and ``torchrun`` also
  forwards the signal it got, so a second SIGTERM moments after the first is normal; letting
  it abort the save would turn a graceful stop into a lost step. Only a signal this context
  does not handle (the scheduler's SIGKILL) ends the save, and the checkpoint protocol
  (io/checkpoint.py's [Note: atomicity protocol]) then leaves the previous checkpoint as the
  latest.
- Ctrl-C. At a terminal Ctrl-C means "stop", and after a long step plus a save the user may
  want out at once. The first Ctrl-C is a stop request like SIGTERM (rank 0 says so on
  stderr); a second Ctrl-C before the stop is agreed raises ``KeyboardInterrupt``, as Python
  does without this context: no new checkpoint, the previous one stays the latest. Once the
  stop is agreed, Ctrl-C waits for the save like SIGTERM. ``signals=(signal.SIGTERM,)``
  leaves Ctrl-C entirely to Python.
- The handler records and nothing more. Python runs it between two bytecodes of the main
  thread, possibly in the middle of tqdm writing to ``sys.stderr``, whose buffer would raise
  "reentrant call"; so the Ctrl-C line goes out with ``os.write`` on file descriptor 2.
- SA_RESTART. The C-level handler can interrupt any thread of the process; installed with
  ``signal.siginterrupt(sig, False)``, a thread blocked in a read or write (gloo's sockets, the
  I/O threads) has the call restarted by the kernel instead of failing with EINTR.
- The main thread only: Python runs signal handlers there and lets only it install them.
- Nothing is re-delivered when the context exits: a signal after the last check stays in
  ``stop.signal`` for the program to look at. The previous handlers are back, so a SIGTERM
  after the exit meets the default action again: enter the context outside the engine's, so
  that ``close()`` (which removes the swap files) runs while signals are still only recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal as _signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch

__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "Preemption", "Terminated", "preemption",
           "terminate_as_interrupt", "with_hangup"]

EXIT_PREEMPTED = 75
"""Exit code after a stop for SIGTERM (or any signal but SIGINT): ``EX_TEMPFAIL`` of
``sysexits.h``, "try again later", which a job script or a pod's failure policy can requeue on."""

EXIT_INTERRUPTED = 130
"""Exit code after a stop for Ctrl-C (SIGINT): the shell's code for it."""

_Handler = Callable[[int, FrameType | None], Any] | int | None


class Preemption:
    """Records SIGTERM (and Ctrl-C) while active; the loop asks ``stop_requested`` at each step
    boundary. See [Note: a signal is a request, answered at the step boundary]."""

    def __init__(self, signals: Iterable[int] = (_signal.SIGTERM, _signal.SIGINT)) -> None:
        self.signals = tuple(_signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("outcore.preemption: give at least one signal to handle")
        self._previous: dict[_signal.Signals, _Handler] | None = None
        self._highest: _signal.Signals | None = None  # of those this process received
        self._agreed: _signal.Signals | None = None  # the stop every rank agreed on
        self._count = 0
        self._interrupts = 0

    # -- the context -------------------------------------------------------------------------
    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "outcore.preemption() must be entered in the main thread: Python runs signal "
                f"handlers only there, and this is thread {threading.current_thread().name!r}")
        if self._previous is not None:
            raise RuntimeError("this outcore.preemption() context is already active")
        previous: dict[_signal.Signals, _Handler] = {}
        try:
            for sig in self.signals:
                previous[sig] = _signal.signal(sig, self._on_signal)
                _signal.siginterrupt(sig, False)  # SA_RESTART: blocked reads and writes go on
        except BaseException:
            _restore(previous)
            raise
        self._previous = previous
        return self

    def __exit__(self, *exc: object) -> None:
        previous, self._previous = self._previous, None
        _restore(previous or {})

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = _signal.Signals(signum)
        self._count += 1
        if self._highest is None or sig > self._highest:
            self._highest = sig
        if sig != _signal.SIGINT or self._agreed is not None:
            return
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt
        if os.environ.get("RANK", "0") == "0":
            # on a line of its own: a progress bar's line is not ended yet
            os.write(2, b"\noutcore: Ctrl-C: stopping at the next step boundary; "
                        b"press Ctrl-C again to stop at once\n")

    # -- what the loop asks ------------------------------------------------------------------
    def stop_requested(self, engine: Any = None) -> bool:
        """Whether to stop now, at this step boundary.

        With an ``engine`` of several ranks this is a collective (a one-number all-reduce):
        call it at the same point on every rank, and every rank gets the same answer. Without
        one, it answers for this process alone. Once True it stays True, with no collective.
        """
        if self._agreed is not None:
            return True
        flag = int(self._highest or 0)
        if engine is not None and engine.world_size > 1:
            rt = engine.rt
            t = rt.accel.to_device(torch.tensor([flag], dtype=torch.int64))
            flag = int(rt.comm.all_reduce_max(t).cpu()[0])
        if flag:
            self._agreed = _signal.Signals(flag)
        return self._agreed is not None

    @property
    def requested(self) -> bool:
        """Whether this process has received a signal (no collective; for display)."""
        return self._highest is not None

    @property
    def signal(self) -> _signal.Signals | None:
        """The signal the stop was agreed on, else the highest-numbered one received here (SIGTERM
        outranks SIGINT), else None."""
        return self._agreed or self._highest

    @property
    def received(self) -> int:
        """How many handled signals arrived while the context was active."""
        return self._count

    @property
    def exit_code(self) -> int:
        """What to exit with: 130 after Ctrl-C, 75 after another signal, 0 if none came."""
        sig = self.signal
        if sig is None:
            return 0
        return EXIT_INTERRUPTED if sig == _signal.SIGINT else EXIT_PREEMPTED


def with_hangup(signals: tuple[int, ...]) -> tuple[int, ...]:
    """``signals`` and SIGHUP (the terminal or SSH session closed: its default action ended a
    run mid-step, with no checkpoint, its swap and locks left), unless the process was started
    ignoring it (``nohup``): such a run is meant to outlive its terminal, and stays so."""
    hup = getattr(_signal, "SIGHUP", None)
    if hup is None or _signal.getsignal(hup) is _signal.SIG_IGN:
        return signals
    return (*signals, hup)


def preemption(signals: Iterable[int] = (_signal.SIGTERM, _signal.SIGINT)) -> Preemption:
    """A context that turns ``signals`` into a stop request the loop asks for at each step
    boundary with ``stop_requested(engine)`` (every rank gets the same answer). Main thread
    only; the previous handlers come back on exit. Ctrl-C twice stops at once."""
    return Preemption(signals)


def _restore(previous: dict[_signal.Signals, _Handler]) -> None:
    for sig, handler in previous.items():
        # None: the previous handler was installed outside Python and cannot be put back
        _signal.signal(sig, _signal.SIG_DFL if handler is None else handler)


class Terminated(KeyboardInterrupt):
    """A stop signal where no step boundary answers it (a command's start-up, its report).

    [Note: a stop signal outside the loop]
    Before the training loop's ``preemption`` context (building the model, creating the
    swap file, ``outcore probe``'s measurement), SIGTERM's default action ended the process
    where it stood, leaving a swap file as large as the model and the run folder's lock.
    ``terminate_as_interrupt`` raises this in the main thread instead, as Python raises
    ``KeyboardInterrupt`` for Ctrl-C, so the clean-up Ctrl-C already gets (contexts exiting,
    swap files deleted, a folder the command made removed) runs for SIGTERM too; it is a
    ``KeyboardInterrupt`` so that every such path catches it without a second list."""

    def __init__(self, signum: int) -> None:
        super().__init__(_signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def terminate_as_interrupt(signals: Iterable[int] = (_signal.SIGTERM,)) -> Iterator[None]:
    """While active, ``signals`` raise ``Terminated`` in the main thread ([Note: a stop
    signal outside the loop]); a ``preemption`` context inside it takes them over and gives
    them back. Once one was raised the signals stay ignored, past the context: the command
    is ending, and a repeat (torchrun forwards one) must not kill its clean-up or its exit.
    Elsewhere than the main thread it does nothing (Python lets only that one install
    handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _: FrameType | None) -> None:
        for sig in previous:  # a repeat (torchrun forwards one, schedulers send several)
            _signal.signal(sig, _signal.SIG_IGN)  # must not cut the clean-up short
        raise Terminated(signum)

    previous: dict[_signal.Signals, _Handler] = {}
    for sig in signals:
        previous[_signal.Signals(sig)] = _signal.signal(sig, stop)
    try:
        yield
    except Terminated:
        raise  # the signals stay ignored: the command is ending, a repeat would kill its exit
    except BaseException:
        _restore(previous)
        raise
    else:
        _restore(previous)
