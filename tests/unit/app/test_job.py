"""What ``outcore train --resume`` says about the run it continues (app/job.py)."""

from __future__ import annotations

import pytest

from outcore.app import job as jobs


def _client(batch: int) -> dict:
    return {"run": {"options": {"model": "tiny"}, "effective": {"batch": batch}}}


@pytest.mark.parametrize(("world", "batch", "said"), [
    ("1", 2, "1 rank (the run had 2): the global batch is 2 x 1 = 2 sequences, the run's "
             "2 x 2 = 4; give --batch 4 to keep it"),
    ("1", 4, "1 rank (the run had 2): the global batch is 4 x 1 = 4 sequences, the run's "
             "2 x 2 = 4; it stays the same"),
    ("3", 2, "3 ranks (the run had 2): the global batch is 2 x 3 = 6 sequences, the run's "
             "2 x 2 = 4; no --batch keeps it at 3 ranks"),
])
def test_a_resume_at_another_number_of_ranks_names_the_global_batch(
        monkeypatch: pytest.MonkeyPatch, world: str, batch: int, said: str) -> None:
    """Resumed on 1 rank, a 2-rank run trained on half its global batch without a word
    (a --batch given again to keep it was the only thing named)."""
    monkeypatch.setenv("WORLD_SIZE", world)
    assert jobs._world_change({"world_size": 2}, _client(2), batch) == [said]


def test_the_same_ranks_or_an_old_record_say_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert jobs._world_change({"world_size": 2}, _client(2), 8) == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert jobs._world_change({"world_size": 2}, {"model": "tiny"}, 2) == []
