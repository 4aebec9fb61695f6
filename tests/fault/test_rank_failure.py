"""A rank that dies or stops answering: the others stop with a clear error, never hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from tests.distributed import _free_port, world_env


def _rank(rank: int, port: int, fault: str, timeout_s: float, queue: mp.Queue,
          env: dict[str, str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", **env)
    torch.set_num_threads(1)
    import outcore
    from tests.common import VOCAB, Quirky

    cfg = outcore.Config(dtype="fp32", comm={"timeout_s": timeout_s},
                         zero={"persistence_threshold_bytes": 0})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = Quirky()
    engine = outcore.initialize(model, cfg)
    idx = torch.randint(0, VOCAB, (2, 8))
    for step in range(4):
        if step == 2 and rank == 1:
            if fault == "die":
                os._exit(3)
            time.sleep(3600)  # alive but silent
        start = time.monotonic()
        try:
            engine.backward(engine(idx, idx))
            engine.step()
        except outcore.CommError as err:
            queue.put(("CommError", str(err), time.monotonic() - start))
            return
        except BaseException as err:  # noqa: BLE001  (reported to the test as a failure)
            queue.put((type(err).__name__, str(err), time.monotonic() - start))
            return
    queue.put(("finished", "", 0.0))


@pytest.mark.parametrize(("fault", "timeout_s", "limit_s"), [("die", 60.0, 20.0),
                                                             ("hang", 8.0, 40.0)])
def test_surviving_rank_fails_clearly_within_the_timeout(fault: str, timeout_s: float,
                                                         limit_s: float) -> None:
    env = world_env(2)  # on the CPU where one GPU would have to hold both ranks
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, fault, timeout_s, queue, env),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, message, waited = queue.get(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert kind == "CommError", (kind, message)
    assert "another rank probably died or stopped answering" in message
    assert f"comm.timeout_s={timeout_s:g}" in message
    assert waited < limit_s  # a dead peer is noticed at once; a silent one after the timeout
