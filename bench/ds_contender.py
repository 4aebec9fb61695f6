"""DeepSpeed ZeRO-3 contender row for bench/train.py; runs inside DeepSpeed's own venv.

    ~/.cache/outcore-peers/ds-venv/bin/python bench/ds_contender.py --spec '{"model": ...}'

Same model (outcore.app.models' GPT preset, tied head), same fixed token batch, same AdamW
hyper-parameters, same timing loop as bench/train.py's rows. Offload follows
../shared/peers/deepspeed/train_zero3.py: params and optimizer state on NVMe with
``max_in_cpu=0`` (otherwise DeepSpeed keeps a model under 1e9 parameters in RAM) and
``stage3_max_reuse_distance=0`` (otherwise step 1 fails, DeepSpeed issue #3062); DeepSpeed's
defaults elsewhere (aio block 1 MiB, queue depth 8, sub_group_size 1e9). Prints one
``RESULT {json}`` line, as bench/train.py's workers do.

outcore is not installed in this venv: its models.py is loaded from the repo through a bare
namespace stub, so the package's ``__init__`` does not run. The modules models.py imports
need outcore's light dependencies in this venv (DeepSpeed brings pydantic and psutil):

    ~/.cache/outcore-peers/ds-venv/bin/pip install pyyaml xxhash safetensors tqdm
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_models():
    pkg = types.ModuleType("outcore")
    pkg.__path__ = [str(REPO / "outcore")]  # submodules import; __init__.py does not run
    sys.modules.setdefault("outcore", pkg)
    try:
        return importlib.import_module("outcore.app.models")
    except ModuleNotFoundError as e:  # the row's log says what to install, not a traceback
        raise SystemExit(f"ds_contender: {e.name} is missing from DeepSpeed's venv; "
                         f"{Path(sys.executable).parent / 'pip'} install pyyaml xxhash "
                         "safetensors tqdm") from None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True, help="JSON from bench/train.py")
    spec = json.loads(ap.parse_args().spec)
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(k, v)

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    if spec.get("compute_threads"):
        torch.set_num_threads(spec["compute_threads"])  # as every other row of the table

    sys.path.insert(0, str(REPO / "bench"))
    from train_worker import (  # the same data, step and timing loop as every other row
        engine_step,
        make_batch,
        timed_steps,
    )

    models = load_models()
    hp = spec["hp"]
    swap = spec["nvme_path"]
    zero = {
        "stage": 3, "overlap_comm": False, "contiguous_gradients": True,
        "stage3_param_persistence_threshold": 1e5,
        "offload_param": {"device": "nvme", "nvme_path": swap, "pin_memory": False,
                          "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap, "pin_memory": False},
        "stage3_max_reuse_distance": 0,
    }
    zero.update(spec.get("ds_zero", {}))
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": spec["dtype"] == "bf16"},
        "fp16": {"enabled": spec["dtype"] == "fp16"},
        "optimizer": {"type": "Adam", "params": {"lr": hp["lr"], "betas": hp["betas"],
                                                  "eps": hp["eps"],
                                                  "weight_decay": hp["weight_decay"]}},
        "gradient_clipping": spec["clip"], "zero_optimization": zero,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    torch.manual_seed(0)
    model = models.build_model(spec["model"])
    # Partition under zero.Init with the config, as DeepSpeed documents. Without it, 0.19.8's
    # ZeRO-3 calls Init(dtype=<the params' dtype>) itself, and Init's `dtype or fp16 if
    # is_fp16_supported() else bf16` precedence (partition_parameters.py) gives NVMe-swapped
    # params bf16 in an fp32 run, which a CPU without native bf16 emulates (checked
    # 2026-11-23 on the AMD EPYC kind: bf16 matmuls with params on NVMe, fp32 with this line).
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=ds_config)
    init_s = time.perf_counter() - t0
    cfg = models.resolve_config(spec["model"])
    x, y = make_batch(cfg.vocab, spec["batch"], spec["seq"])
    res = timed_steps(engine_step(engine, x, y), spec["steps"], spec["warmup"])
    res.update(init_s=round(init_s, 1), params=models.num_params(cfg),
               deepspeed=deepspeed.__version__, torch=torch.__version__,
               optimizer_class=type(getattr(opt, "optimizer", opt)).__name__,
               zero_config=zero, torch_threads=torch.get_num_threads(), dtype=spec["dtype"])
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
