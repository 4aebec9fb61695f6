"""The three places bytes can live."""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """A place bytes live, fastest first: iterating ``Tier`` gives the order reports use.

    [Note: two spellings of a tier]
    The config names where state is offloaded *to* (``offload.params: none | cpu | nvme``,
    DeepSpeed's spelling, ``none`` for not offloaded); the ledger, ``memory_report()`` and the
    metrics name the tier itself (``device | host | nvme``). ``for_placement`` is the one
    mapping from the first to the second; nothing else spells it out.
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @classmethod
    def for_placement(cls, placement: str) -> Tier:
        """Map a config value (``none | cpu | nvme``) to the tier it names."""
        return _BY_PLACEMENT[placement]


_BY_PLACEMENT = {"none": Tier.DEVICE, "cpu": Tier.HOST, "nvme": Tier.NVME}
