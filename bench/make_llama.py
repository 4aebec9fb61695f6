"""Write a random-weights Llama as a real Hugging Face folder, one tensor at a time.

``config.json`` + ``model-XXXXX-of-YYYYY.safetensors`` shards (bf16 by default) +
``model.safetensors.index.json``, exactly what ``save_pretrained`` writes, for sizes that do
not fit this machine's memory: no model object is built, and host memory holds one tensor
(at most the embedding, 0.4 GB at 30B) plus a pool of random values. Weights are drawn once
into that pool (normal, std 0.02; norms are ones) and each tensor tiles it from a random
offset, so writing runs at the disk's rate instead of the random generator's.

    python bench/make_llama.py --size 13b --out /work/llama-13b
    python bench/make_llama.py --size 30b --out /work/llama-30b

Sizes: ``13b`` (40 layers, hidden 5120, MLP 13824: 13.0B parameters, 26.0 GB in bf16),
``30b`` (60 layers, hidden 6656, MLP 17920: 32.5B, 65.0 GB), ``tiny`` (for tests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from outcore.io.safetensors_stream import StreamWriter, TensorSpec  # noqa: E402

SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": 320},
    "1b": {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 22,
           "num_attention_heads": 16, "vocab_size": 32000},
    "13b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
            "num_attention_heads": 40, "vocab_size": 32000},
    "30b": {"hidden_size": 6656, "intermediate_size": 17920, "num_hidden_layers": 60,
            "num_attention_heads": 52, "vocab_size": 32000},
}
POOL = 1 << 24  # random values drawn once (32 MB in bf16)


def config(size: str) -> dict:
    s = SIZES[size]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2, "num_key_value_heads": s["num_attention_heads"],
            "initializer_range": 0.02, **s}


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the order save_pretrained writes them."""
    h, m, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "mlp.down_proj.weight", (h, m)), (p + "mlp.gate_proj.weight", (m, h)),
                (p + "mlp.up_proj.weight", (m, h)),
                (p + "post_attention_layernorm.weight", (h,))]
        out += [(p + f"self_attn.{k}_proj.weight", (h, h)) for k in "kovq"]
    return out + [("lm_head.weight", (v, h)), ("model.norm.weight", (h,))]


def write(size: str, out: Path, shard_bytes: int, dtype: torch.dtype) -> None:
    cfg = config(size)
    specs = [TensorSpec(n, dtype, s) for n, s in tensors(cfg)]
    files: list[list[TensorSpec]] = [[]]
    for spec in specs:
        if files[-1] and sum(s.nbytes for s in files[-1]) + spec.nbytes > shard_bytes:
            files.append([])
        files[-1].append(spec)
    total = sum(s.nbytes for s in specs)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(POOL, generator=gen) * 0.02).to(dtype)
    weight_map, t0 = {}, time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"llama-{size}") as bar:
        for i, group in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            with StreamWriter(partial / name, group, {"format": "pt"}) as w:
                for spec in group:
                    w.write(spec.name, _values(spec, pool, gen).view(spec.shape))
                    weight_map[spec.name] = name
                    bar.update(spec.nbytes)
                w.finish()
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (partial / "config.json").write_text(json.dumps(cfg, indent=2))
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    params = sum(s.nbytes for s in specs) // dtype.itemsize
    print(f"{out}: {params / 1e9:.2f}B params, {total / 1e9:.1f} GB in {len(files)} files, "
          f"{time.perf_counter() - t0:.0f} s")


def _values(spec: TensorSpec, pool: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    numel = 1
    for d in spec.shape:
        numel *= d
    if len(spec.shape) == 1:  # RMSNorm weights
        return torch.ones(numel, dtype=pool.dtype)
    start = int(torch.randint(0, POOL, (1,), generator=gen))
    reps = -(-(start + numel) // POOL)
    if reps == 1:
        return pool[start : start + numel]
    return pool.repeat(reps)[start : start + numel]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    write(a.size, a.out, int(a.shard_gb * 1e9), dtype)


if __name__ == "__main__":
    main()
