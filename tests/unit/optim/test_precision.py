"""Dynamic loss scaling (precision.py's [Note: skip, then shrink]): the scale starts at
``2**initial_scale_power``, halves on each overflow (never below ``min_scale``), doubles after
every ``growth_interval`` clean steps counted from the last overflow, and a disabled scaler
stays at 1 whatever happens; its state round-trips through ``state_dict``."""

from __future__ import annotations

from outcore.config import LossScaleConfig
from outcore.optim.precision import LossScaler


def _scaler(power: int = 4, interval: int = 3, min_scale: float = 1.0,
            enabled: bool = True) -> LossScaler:
    cfg = LossScaleConfig(initial_scale_power=power, growth_interval=interval,
                          min_scale=min_scale)
    return LossScaler(cfg, enabled=enabled)


def test_initial_scale_is_two_to_the_power() -> None:
    assert _scaler(power=4).scale == 16.0
    assert _scaler(power=0).scale == 1.0
    s = _scaler()
    assert (s.good_steps, s.skipped_steps) == (0, 0)


def test_defaults_match_the_config() -> None:
    s = LossScaler(LossScaleConfig(), enabled=True)
    assert s.scale == 2.0**16
    assert s.growth_interval == 1000 and s.min_scale == 1.0


def test_scale_doubles_after_growth_interval_clean_steps() -> None:
    s = _scaler(power=4, interval=3)
    scales = []
    for _ in range(7):
        s.update(overflow=False)
        scales.append(s.scale)
    assert scales == [16, 16, 32, 32, 32, 64, 64]
    assert s.good_steps == 7 and s.skipped_steps == 0


def test_overflow_halves_the_scale_and_counts_a_skipped_step() -> None:
    s = _scaler(power=4, interval=1000)
    s.update(overflow=True)
    assert s.scale == 8.0
    s.update(overflow=True)
    assert s.scale == 4.0
    assert s.skipped_steps == 2 and s.good_steps == 0


def test_overflow_restarts_the_growth_count() -> None:
    s = _scaler(power=4, interval=3)
    s.update(overflow=False)
    s.update(overflow=False)
    s.update(overflow=True)  # 16 -> 8, and the two clean steps no longer count
    assert s.scale == 8.0 and s.good_steps == 0
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 8.0
    s.update(overflow=False)
    assert s.scale == 16.0


def test_scale_never_drops_below_min_scale() -> None:
    s = _scaler(power=3, min_scale=2.0)
    for _ in range(10):
        s.update(overflow=True)
    assert s.scale == 2.0
    assert s.skipped_steps == 10


def test_disabled_scaler_stays_at_one() -> None:
    s = _scaler(power=10, interval=1, enabled=False)
    assert s.scale == 1.0 and not s.enabled
    for overflow in (True, False, False, True, False):
        s.update(overflow=overflow)
    assert s.scale == 1.0
    assert (s.good_steps, s.skipped_steps) == (0, 0)


def test_state_dict_round_trips() -> None:
    s = _scaler(power=5, interval=2)
    for overflow in (False, True, False, False, False):
        s.update(overflow=overflow)
    state = s.state_dict()
    assert state == {"scale": 32.0, "good_steps": 3, "skipped_steps": 1}
    other = _scaler(power=12, interval=2)
    other.load_state_dict(state)
    assert (other.scale, other.good_steps, other.skipped_steps) == (32.0, 3, 1)
    other.update(overflow=False)  # the 4th clean step: grows, as the original would
    s.update(overflow=False)
    assert other.scale == s.scale == 64.0


def test_overflows_that_go_on_at_the_minimum_scale_are_named_once() -> None:
    """At its minimum the scale cannot fall further and every step is skipped: torch's
    GradScaler goes on silently, DeepSpeed raises; here one warning says so."""
    import warnings

    import pytest

    from outcore.optim.precision import STUCK

    s = _scaler(power=2, min_scale=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2 + STUCK - 1):  # 4 -> 2 -> 1, then at the floor
            s.update(overflow=True)
    with pytest.warns(UserWarning, match=f"{STUCK} steps in a row skipped at the minimum loss "
                      r"scale \(1\)"):
        s.update(overflow=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.update(overflow=True)  # said once
        s.update(overflow=False)  # a clean step starts the count again
        for _ in range(STUCK - 1):
            s.update(overflow=True)
