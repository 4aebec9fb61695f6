"""The byte ledger: a ``Charge`` is the only way bytes get on it or off it (ledger.py's [Note: a
charge belongs to its owner]). ``set`` replaces a charge's amount, ``change`` moves it, and
``release`` (also leaving ``with``, or the finalizer of a forgotten charge) takes it off, any
number of times; ``snapshot()`` reports ``"<tier>.<kind>"``, ``"peak.<tier>"`` and
``"peak.<tier>.<kind>"``, the peaks being the highest totals ever held."""

from __future__ import annotations

import gc
import threading

import pytest

from outcore.offload.ledger import Charge, Kind, Ledger
from outcore.offload.tier import Tier


def test_charge_puts_its_bytes_on_the_ledger_under_tier_and_kind() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.HOST, Kind.PARAMS, 100)
    assert isinstance(charge, Charge)
    assert charge.nbytes == 100
    assert ledger.snapshot() == {"host.params": 100, "peak.host": 100,
                                 "peak.host.params": 100}
    assert ledger.tier_bytes("host") == 100
    assert ledger.tier_bytes("nvme") == 0


def test_a_charge_of_zero_bytes_leaves_no_key() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.NVME, Kind.GRADS)
    assert charge.nbytes == 0
    assert ledger.snapshot() == {}


def test_set_replaces_the_amount_and_change_moves_it() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.DEVICE, Kind.GRADS, 10)
    charge.set(40)
    assert charge.nbytes == 40
    assert ledger.snapshot()["device.grads"] == 40
    charge.change(5)
    assert charge.nbytes == 45
    charge.change(-25)
    assert charge.nbytes == 20
    assert ledger.snapshot()["device.grads"] == 20
    charge.set(0)
    assert ledger.snapshot()["device.grads"] == 0


def test_charges_of_one_key_add_up_and_each_owner_moves_only_its_own() -> None:
    ledger = Ledger()
    a = ledger.charge(Tier.HOST, Kind.OPTIMIZER, 30)
    b = ledger.charge(Tier.HOST, Kind.OPTIMIZER, 12)
    assert ledger.snapshot()["host.optimizer"] == 42
    a.set(0)
    assert ledger.snapshot()["host.optimizer"] == 12
    assert b.nbytes == 12


def test_snapshot_keys_per_tier_and_kind_with_peaks() -> None:
    ledger = Ledger()
    params = ledger.charge(Tier.HOST, Kind.PARAMS, 100)
    grads = ledger.charge(Tier.HOST, Kind.GRADS, 50)
    swap = ledger.charge(Tier.NVME, Kind.MASTER, 7)
    grads.set(0)
    params.set(30)
    snap = ledger.snapshot()
    assert snap == {
        "host.grads": 0, "host.params": 30, "nvme.master": 7,
        "peak.host": 150,  # params 100 + grads 50 at once
        "peak.nvme": 7,
        "peak.host.grads": 50, "peak.host.params": 100, "peak.nvme.master": 7,
    }
    assert swap.nbytes == 7


def test_tier_peak_is_the_highest_total_not_the_sum_of_kind_peaks() -> None:
    """Kinds that peak at different times: the tier's peak is what was held at once."""
    ledger = Ledger()
    a = ledger.charge(Tier.HOST, Kind.UNSHARDED, 80)
    a.set(0)
    b = ledger.charge(Tier.HOST, Kind.ACTIVATIONS, 60)
    snap = ledger.snapshot()
    assert snap["peak.host.unsharded"] == 80
    assert snap["peak.host.activations"] == 60
    assert snap["peak.host"] == 80
    assert b.nbytes == 60


def test_reset_peaks_starts_from_the_current_values() -> None:
    ledger = Ledger()
    a = ledger.charge(Tier.HOST, Kind.PARAMS, 100)
    a.set(10)
    ledger.reset_peaks()
    snap = ledger.snapshot()
    assert snap["peak.host"] == 10
    assert snap["peak.host.params"] == 10
    a.set(25)
    assert ledger.snapshot()["peak.host"] == 25


def test_release_takes_the_bytes_off_and_a_second_release_is_harmless() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.HOST, Kind.IO_BUFFERS, 4096)
    other = ledger.charge(Tier.HOST, Kind.IO_BUFFERS, 8)
    charge.release()
    assert charge.nbytes == 0
    assert ledger.snapshot()["host.io_buffers"] == 8
    charge.release()
    assert ledger.snapshot()["host.io_buffers"] == 8  # not 8 - 4096
    assert other.nbytes == 8


def test_release_of_a_never_set_charge_is_harmless() -> None:
    ledger = Ledger()
    keep = ledger.charge(Tier.NVME, Kind.ACTIVATIONS, 3)
    ledger.charge(Tier.NVME, Kind.ACTIVATIONS).release()
    assert ledger.snapshot()["nvme.activations"] == 3
    assert keep.nbytes == 3


def test_a_released_charge_can_be_set_again() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.HOST, Kind.PARAM_CACHE, 5)
    charge.release()
    charge.set(9)
    assert ledger.snapshot()["host.param_cache"] == 9


def test_with_block_releases_the_charge_also_on_error() -> None:
    ledger = Ledger()
    with ledger.charge(Tier.DEVICE, Kind.UNSHARDED, 64) as charge:
        assert ledger.snapshot()["device.unsharded"] == 64
        charge.change(64)
    assert ledger.snapshot()["device.unsharded"] == 0
    with pytest.raises(KeyError), ledger.charge(Tier.DEVICE, Kind.UNSHARDED, 32):
        raise KeyError("boom")
    assert ledger.snapshot()["device.unsharded"] == 0
    assert ledger.snapshot()["peak.device.unsharded"] == 128


def test_a_charge_collected_without_release_is_settled_by_its_finalizer() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.HOST, Kind.GRADS, 1000)
    charge.change(24)
    assert ledger.tier_bytes("host") == 1024
    del charge
    gc.collect()
    assert ledger.tier_bytes("host") == 0
    assert ledger.snapshot()["host.grads"] == 0
    assert ledger.snapshot()["peak.host.grads"] == 1024


def test_a_released_then_collected_charge_is_not_taken_off_twice() -> None:
    ledger = Ledger()
    keep = ledger.charge(Tier.HOST, Kind.MASTER, 7)
    charge = ledger.charge(Tier.HOST, Kind.MASTER, 100)
    charge.release()
    del charge
    gc.collect()
    assert ledger.snapshot()["host.master"] == 7
    assert keep.nbytes == 7


def test_an_owner_cycle_collected_settles_its_charge() -> None:
    """The finalizer holds no reference to the charge, so an owner in a reference cycle (the
    common case: a shard and its group) is collected and its bytes leave the ledger."""
    ledger = Ledger()

    class Owner:
        def __init__(self) -> None:
            self.charge = ledger.charge(Tier.NVME, Kind.PARAMS, 512)
            self.me = self

    Owner()
    assert ledger.tier_bytes("nvme") == 512
    gc.collect()
    assert ledger.tier_bytes("nvme") == 0


def test_a_charge_cannot_go_negative() -> None:
    ledger = Ledger()
    charge = ledger.charge(Tier.HOST, Kind.GRADS, 5)
    with pytest.raises(AssertionError):
        charge.change(-6)
    assert charge.nbytes == 5
    assert ledger.snapshot()["host.grads"] == 5


def test_concurrent_changes_from_several_threads_sum_exactly() -> None:
    ledger = Ledger()
    shared = ledger.charge(Tier.HOST, Kind.IO_BUFFERS)
    own = [ledger.charge(Tier.HOST, Kind.IO_BUFFERS) for _ in range(4)]
    rounds = 2000
    start = threading.Barrier(4)

    def work(i: int) -> None:
        start.wait()
        for n in range(rounds):
            shared.change(3)
            own[i].change(1)
            if n % 2:
                shared.change(-1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert shared.nbytes == 4 * (3 * rounds - rounds // 2)
    assert [c.nbytes for c in own] == [rounds] * 4
    total = shared.nbytes + 4 * rounds
    assert ledger.snapshot()["host.io_buffers"] == total
    assert ledger.tier_bytes("host") == total
    assert ledger.snapshot()["peak.host"] >= total


def test_a_charge_dropped_while_its_ledger_is_locked_does_not_deadlock() -> None:
    """The collector may finalize a charge while this very thread holds the ledger's lock
    (inside ``_hold``): the finalizer queues its amount instead of taking the lock
    ([Note: a finalizer never takes the lock]), and the next read applies it."""
    ledger = Ledger()
    box = [ledger.charge(Tier.HOST, Kind.GRADS, 100)]
    done = threading.Event()

    def drop_inside_the_lock() -> None:
        with ledger._lock:
            box.clear()  # the last reference: the finalizer runs here, on this thread
        done.set()

    threading.Thread(target=drop_inside_the_lock, daemon=True).start()
    assert done.wait(10), "the finalizer waited for a lock its own thread held"
    assert ledger.snapshot()["host.grads"] == 0
    assert ledger.tier_bytes("host") == 0
