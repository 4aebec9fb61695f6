"""How glibc's ``malloc`` treats the large blocks torch frees: given back, or kept for reuse.

[Note: glibc keeps freed shards]
With optimizer state on NVMe, host memory holds only what is in flight: a few gathered
groups, gradient shards waiting for their update, staging buffers. All of these are large
(megabytes) and short-lived. glibc's ``malloc`` serves blocks above a *dynamic* threshold
with ``mmap`` and everything below from its heap; each time a large block is freed the
threshold rises to that block's size (up to 32 MiB). After the first few frees, most
shard-sized blocks come from the heap, and a heap returns memory to the system only from
its top, so freed shards stay resident below live blocks and peak RSS grows well past what
is in flight, for no gain in step time (measured, thresholds side by side:
bench/results/2026-11-22-intel-amx-bf16-training-held-gradients.md).
Fixing the threshold at 1 MiB (what ``MALLOC_MMAP_THRESHOLD_`` does from the environment)
keeps every large block in its own mapping, returned to the system by ``free``. Small
objects (Python's, torch's metadata) are unaffected.

[Note: page faults are the other cost]
Memory given back to the system comes back as fresh pages: every first touch of each 4 KiB
page is a page fault that the kernel serves by zeroing the page. Activations and autograd's
gradients are allocated and freed every step, so a process that gives them back pays this
again each step: with everything in memory, that system time alone makes a step slower
than plain PyTorch's. Plain PyTorch pays it or not by accident: in some processes its heap
happens to hold freed blocks big enough for the largest tensors (no faults in forward and
backward), in others not (a fault per page of every activation); the logits, over glibc's
32 MiB ceiling for the dynamic threshold, are otherwise always mapped fresh. Where the
optimizer state is in memory the host is sized for the whole model anyway, so outcore makes
the reuse deliberate: no ``mmap`` for blocks (``M_MMAP_MAX`` 0) and no trimming of the
heap's top, so each step's tensors reuse the last step's pages. This covers the main heap,
where torch's CPU compute allocates (forward and CPU backward run on the calling thread);
glibc still maps blocks over 64 MiB fresh for other threads' heaps. With the state in GPU
memory the host is not sized for the model, so the setting is only applied where the state
lives in host memory. With it a step takes almost no page faults and runs as fast as plain
PyTorch's (measured: bench/results/2026-11-22-intel-amx-bf16-training-page-reuse.md).

[Note: reuse on a small host, when asked]
With the optimizer state on NVMe the first setting costs time in proportion to the
activations: at large batches the kernel's page zeroing becomes a large share of each step,
and on a host with few cores that time is taken from compute.
``offload.reuse_freed_memory: true`` serves every block from the heap there too (and where
the state is in device memory, for which nothing is set by default), so most of a step's
pages are reused: steps get shorter at every batch size, and peak RSS higher, the more so
the larger the batch (measured side by side:
bench/results/2026-11-22-intel-amx-bf16-training-reuse-freed-memory.md). A
free heap top beyond a bound still goes back to the system, so one huge transient at the
top (an evaluation batch, say) is not kept for good; but blocks freed below a live one
(torch allocates small blocks after large ones) stay, so this bounds the top, not the RSS.
The bound is ``REUSE_TRIM_BYTES`` until the first step ends, then a ``REUSE_ROOM``-th of the
memory this rank has left (where the first step decided reuse, at least what it held: the
next note), at most 2 GiB, all ``mallopt`` takes. It grows because the loss's tensors are the
largest a step makes (the logits in fp32, their log-softmax and its gradient: 250 MiB each at
2048 tokens of a 32,000-word vocabulary), and a loss computed outside the model makes them
where no sample of the step's RSS sees them all; below them, they went back every step: 90%
of a step's page faults on gpt-335m at 4 x 512 tokens (about 200,000), 0.35 CPU-s of the
compute threads' time (bench/results/2026-11-26-intel-amx-bf16-fault-free-steps.md). The
same decision lets the parameters' full-tensor memory be kept (runtime/context.py's [Note:
kept full-tensor memory follows the budget]). Asked for, it applies whatever the host's
room; left unset, the next note decides from the first step, since RSS is what a small host
is short of. It starts once the engine is built (``Runtime.begin_training``): building the
model allocates and frees every full tensor once, and a heap serving that would keep holding
it for the whole run. ``false`` gives large frees back wherever the state is.

[Note: reuse decided by the first step]
Left unset, with the state on NVMe or in device memory, the choice is made once the first
step has shown what one step holds. Until then large frees go back (the first note); the
runtime samples the process's RSS where a step holds the most, as backward begins (every
activation alive) and as the step begins (every gradient not yet consumed), and after the
first step keeps freed memory for reuse, as ``true`` does, if the memory still available to
this rank is at least ``REUSE_ROOM`` times that working set. Reuse makes the heap keep up to
about one working set more (measured on gpt-335m at 512 tokens: peak RSS 1.28 -> 1.80 GiB),
so the factor leaves the host several working sets of room beyond it: a host with room to
spare spends it on fewer page faults (a third of an offloaded step's CPU time on two
cores: bench/results/2026-11-26-intel-amx-bf16-cpu-split.md), and a host that is short, the
case NVMe offload exists for, keeps giving memory back. The available memory is the
machine's or the cgroup's, whichever is smaller (guard/memory.py), shared by the ranks on
this host. The decision is logged; ``false`` keeps the smallest footprint whatever the room.

[Note: a frozen base does not size the host]
The second note's premise, a host sized for the whole model because the optimizer state is
in memory, fails when most of the model is frozen (a LoRA base): the state is the adapters'
few megabytes, while the base is the bulk and was put on NVMe precisely because host
memory is short. Keeping every freed block there holds the base's transient full tensors
resident for good; measured on a LoRA fine-tune with the base on NVMe, it took peak RSS
above the base's own size for no faster step (bench/results/README.md, 'LoRA base on NVMe').
So where fewer than ``MOSTLY_FROZEN`` of the parameters train, the parameters are on NVMe and
the key is unset, large frees are given back as with the state on NVMe: from the build on
when the builder knows (``outcore.init(frozen=True)``, or an engine wrapping an already built
model), else from ``begin_training``. With the base in memory the host holds it anyway, and
the reuse of the second note stays.

Every setting is process-wide, and the last engine built decides, with one exception: an
engine with the key unset and its state in host or device memory does not undo another
engine's setting (a small host's give-back or reuse stays). An engine with its state on NVMe
gives large frees back while it is built, whatever an earlier engine chose. Elsewhere (not
glibc) all of them do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("outcore")

# glibc's mallopt parameter numbers and defaults
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
MMAP_THRESHOLD_BYTES = 1 << 20
REUSE_TRIM_BYTES = 256 << 20  # see [Note: reuse on a small host, when asked]
REUSE_ROOM = 4  # see [Note: reuse decided by the first step]
MOSTLY_FROZEN = 0.5  # trainable fraction below which [Note: a frozen base does not size the host]
_NEVER_TRIM = -1  # mallopt(M_TRIM_THRESHOLD, -1) turns trimming off (glibc: SIZE_MAX)
_MALLOPT_MAX = (1 << 31) - 1  # mallopt's value is a C int

_policy: str | None = None  # "return", "keep" or "reuse", once applied


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (errno kept for ``ctypes.get_errno``), or None where it cannot load."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


def _apply(policy: str, options: list[tuple[int, int]]) -> bool:
    """Set ``options`` (mallopt parameter, value) and remember ``policy``; False if not glibc
    or glibc refused one of them."""
    global _policy
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not all(mallopt(param, value) for param, value in options):
        return False
    _policy = policy
    log.debug("outcore: glibc malloc policy %r: %s", policy, options)
    return True


def return_large_frees_to_os() -> bool:
    """Give large freed blocks back at once (the first note); True if it is in effect."""
    if _policy == "return":
        return True
    return _apply("return", [(_M_MMAP_MAX, _DEFAULT_MMAP_MAX),
                             (_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD),
                             (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)])


def keep_freed_memory_for_reuse(force: bool = False) -> bool:
    """Serve every block from the heap and never trim it (the second note); True if in
    effect. Unless ``force``, does nothing once another policy was applied."""
    if _policy is not None and not force:
        return _policy == "keep"
    return _apply("keep", [(_M_TRIM_THRESHOLD, _NEVER_TRIM), (_M_MMAP_MAX, 0)])


def reuse_freed_memory_on_small_host() -> bool:
    """Serve every block from the heap, trimming its top beyond ``REUSE_TRIM_BYTES`` (the
    third note); True if in effect. An explicit config or the first step asked, so it always
    applies."""
    return _apply("reuse", [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, REUSE_TRIM_BYTES)])


def bound_reused_top(top_bytes: int) -> bool:
    """Under that reuse, let the heap keep a free top of up to ``top_bytes``, never less than
    ``REUSE_TRIM_BYTES`` and never more than ``mallopt`` can take (its value is a C ``int``: a
    larger one would wrap); True if in effect. Does nothing where another policy was applied
    since: the last engine built decides."""
    if _policy != "reuse":
        return False
    trim = min(max(REUSE_TRIM_BYTES, top_bytes), _MALLOPT_MAX)
    return _apply("reuse", [(_M_TRIM_THRESHOLD, trim)])


def reuse_fits(working_set: int, available: int) -> bool:
    """Whether ``available`` bytes leave room to keep freed memory for reuse, for a step that
    holds ``working_set`` bytes ([Note: reuse decided by the first step])."""
    return working_set > 0 and available >= REUSE_ROOM * working_set
