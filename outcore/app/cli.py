"""The ``outcore`` command: ``train``, ``probe``, ``estimate`` and ``consolidate``.

Each subcommand's work lives in its own module (``outcore.app.train``,
``outcore.sizing.probe``, ``outcore.sizing.estimate``, ``outcore.io.checkpoint``), imported
only when that subcommand runs, so ``outcore estimate`` answers without building anything and
one missing part does not break the others. This file only parses arguments, prints results
and applies the error policy.

[Note: the CLI error policy]
* Bad arguments (unknown option, missing value, a size like ``32XB``): exit code 2 and exactly
  one line on stderr, ``outcore <sub>: error: <what is wrong> (see 'outcore <sub> --help')``;
  no usage dump, since the usage of ``outcore train`` is longer than the screen and buries
  the one line that matters.
* ``ConfigError`` or ``DataError`` raised while a subcommand runs (a bad config key, a missing
  data file): also exit 2 and one line; they are the same kind of mistake, found later.
* ``StorageError`` and every other ``OutcoreError`` (disk full, corrupt checkpoint, a part of
  outcore missing from this build): exit 1 and one line; so is memory that ran out (the
  limit named: ``errors.out_of_memory``).
* A closed pipe on stdout (``outcore estimate ... | head``): exit 141, the shell's code for
  SIGPIPE, and nothing printed.
* Ctrl-C: exit 130, the shell's code for SIGINT. During ``outcore train`` the first Ctrl-C
  finishes the step and saves first (a second one stops at once), and SIGTERM (or SIGUSR1:
  train.py's ``STOP_SIGNALS``) does the same with exit 75, ``EX_TEMPFAIL``
  (guard/preemption.py's [Note: a signal is a request, answered at the step boundary]).
* Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import select
import signal
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from outcore.app.arg_types import count, positive, probe_size, size
from outcore.app.models import preset_shape
from outcore.errors import ConfigError, DataError, OutcoreError, StorageError, out_of_memory
from outcore.guard.preemption import (
    EXIT_PREEMPTED,
    Terminated,
    terminate_as_interrupt,
    with_hangup,
)
from outcore.sizing import efficiency as eff
from outcore.sizing import estimate as est
from outcore.sizing.frozen_base import FrozenBaseEstimate, frozen_base
from outcore.units import format_bytes, format_count

__all__ = ["build_parser", "main"]

SUBCOMMANDS = ("train", "probe", "estimate", "consolidate")


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (see [Note: the CLI error policy])."""

    subcommands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _import_part(module: str, what: str) -> ModuleType:
    """Import a subcommand's module, or say in one line that this build lacks it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the module exists but one of its own imports is broken: a bug
        raise OutcoreError(f"this build of outcore has no {module} ({what})") from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outcore")
    except PackageNotFoundError:  # a source checkout that was not pip-installed
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) \
            if pyproject.is_file() else None
        return found[1] if found else "unknown"


def build_parser(with_train_options: bool = False) -> _Parser:
    """The ``outcore`` parser; ``outcore.app.train``'s options are added only when asked for,
    because importing the training job (and torch) for ``outcore estimate`` would be waste."""
    parser = _Parser(prog="outcore", description="ZeRO-Infinity for PyTorch: train models "
                     "larger than device and host memory.")
    parser.add_argument("--version", action="version", version=f"outcore {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = sub.choices

    train = sub.add_parser("train", help="train a model (see 'outcore train --help')",
                           description="Train a model with outcore.")
    if with_train_options:
        job = _import_part("outcore.app.train", "the training job")
        job.add_arguments(train)
        train.set_defaults(run=job.run)

    probe = sub.add_parser("probe", help="measure this machine's disk, memory and matmul rates",
                           description="Measure disk read/write, host copy and matmul rates.")
    probe.add_argument("--path", default=".", help="folder on the disk to measure (default: .)")
    probe.add_argument("--size", type=probe_size,
                       help="at most this many bytes per disk round, e.g. 1GB (default 512MiB; "
                       "sized by time below that; at least 64MiB)")
    probe.add_argument("--json", action="store_true", help="print JSON")
    probe.set_defaults(run=_run_probe)

    cons = sub.add_parser("consolidate", help="write a checkpoint's full weights to one file",
                          description="Gather a sharded checkpoint into one safetensors file.")
    cons.add_argument("ckpt", metavar="CKPT", help="checkpoint folder")
    cons.add_argument("out", metavar="OUT", help="output file, e.g. model.safetensors")
    cons.set_defaults(run=_run_consolidate)

    _add_estimate(sub.add_parser(
        "estimate", help="memory per tier, the largest trainable model, predicted efficiency",
        description="The ZeRO-Infinity paper's memory and bandwidth analysis. Sizes take "
                    "units: 32GB, 1.5TB, 24GiB."))
    return parser


def _add_estimate(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (one of --model, --params, --layers/--hidden)")
    m.add_argument("--model", help="preset name, config.json, or Hugging Face model folder")
    m.add_argument("--params", type=count, help="parameter count, e.g. 1.3B (GPT shape assumed)")
    m.add_argument("--layers", type=positive)
    m.add_argument("--hidden", type=positive)
    m.add_argument("--heads", type=positive, help="default: hidden / 128")
    m.add_argument("--vocab", type=positive, help="default: 50257")
    m.add_argument("--ffn", type=positive, help="MLP width, default: 4 x hidden")
    w = p.add_argument_group("workload")
    w.add_argument("--batch", type=positive, default=1, help="sequences per device (default 1)")
    w.add_argument("--seq", type=positive, help="sequence length (default: the model's, or 1024)")
    w.add_argument("--gpus", "--devices", dest="gpus", type=positive, default=1,
                   help="devices in all (default 1)")
    w.add_argument("--nodes", type=positive, default=1,
                   help="machines the devices are spread over (default 1)")
    w.add_argument("--fp32-grads", action="store_true",
                   help="count an fp32 gradient copy: 20 bytes/param, the paper's accounting")
    w.add_argument("--no-checkpointing", action="store_true", help="keep all activations")
    w.add_argument("--tiles", type=positive, default=1, help="memory-centric tiling factor")
    w.add_argument("--trainable", type=count, metavar="N",
                   help="LoRA: N trainable adapter parameters over the frozen --model, its "
                        "base read in place from its files (e.g. 13.1M)")
    h = p.add_argument_group("largest model (--max-model; any of the sizes implies it)")
    h.add_argument("--max-model", action="store_true", help="largest model per strategy")
    h.add_argument("--gpu-memory", type=size, help="memory per device, e.g. 32GB")
    h.add_argument("--host-memory", type=size, help="host memory per node (default 0)")
    h.add_argument("--nvme", type=size, help="NVMe capacity per node (default 0)")
    e = p.add_argument_group("efficiency")
    e.add_argument("--probe", metavar="FILE.json", help="output of 'outcore probe --json'")
    e.add_argument("--tokens-per-step", type=positive, help="per device (default batch x seq)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_run_estimate)


def _shape(args: argparse.Namespace) -> est.ModelShape | None:
    """The model the options describe, or None; contradictions are ConfigErrors (exit 2)."""
    given = [o for o, v in (("--model", args.model), ("--params", args.params),
                            ("--layers", args.layers)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"give one model description, not {' and '.join(given)}")
    if (args.layers is None) != (args.hidden is None):
        raise ConfigError("--layers and --hidden go together")
    if args.model is not None:
        return est.resolve_model(args.model, _preset_shape)
    if args.params is not None:
        return est.shape_from_params(args.params, seq_len=args.seq or 1024,
                                     vocab=args.vocab or 50257)
    if args.layers is not None:
        heads = args.heads or max(1, args.hidden // 128)
        if args.hidden % heads:
            raise ConfigError(f"--hidden {args.hidden} is not divisible by --heads {heads}")
        return est.ModelShape(layers=args.layers, hidden=args.hidden, heads=heads,
                              vocab=args.vocab or 50257, seq_len=args.seq or 1024, ffn=args.ffn)
    return None


def _preset_shape(name: str) -> est.ModelShape:
    """A preset's shape (ConfigError listing the presets if there is none by that name)."""
    return preset_shape(name)


def _run_estimate(args: argparse.Namespace) -> int:
    # a size of the largest-model group asks for it: given alone, it was ignored without a word
    args.max_model = args.max_model or any(
        v is not None for v in (args.gpu_memory, args.host_memory, args.nvme))
    if args.gpus % args.nodes:  # every node has the same devices (and the probe's host)
        raise ConfigError(f"--gpus ({args.gpus}) must be a multiple of --nodes ({args.nodes})")
    shape = _shape(args)
    if shape is None and not args.max_model and args.probe is None:
        raise ConfigError("give a model (--model, --params or --layers/--hidden), "
                          "--max-model, or --probe")
    state_bytes = est.StateBytes(fp32_grads=4 if args.fp32_grads else 0)
    seq = args.seq or (shape.seq_len if shape else 1024)
    if args.model is not None and shape is not None and seq > shape.seq_len:
        raise ConfigError(f"--seq: {seq} exceeds the model's longest sequence {shape.seq_len}")
    out: dict[str, Any] = {}
    if shape is not None:
        out["memory"] = est.memory_estimate(
            shape, batch=args.batch, seq_len=seq, devices=args.gpus, state_bytes=state_bytes,
            checkpointing=not args.no_checkpointing, tiles=args.tiles)
    if args.trainable is not None:
        if shape is None:
            raise ConfigError("--trainable prices adapters over a model: give --model too")
        rate = (_read_probe(args.probe).get("disk_read_GBps") if args.probe else None)
        out["frozen_base"] = frozen_base(
            shape, args.trainable, base_bytes=_files_bytes(args.model), batch=args.batch,
            seq_len=seq, activations=out["memory"].activations_full, disk_read_GBps=rate)
    if args.max_model:
        if not args.gpu_memory:
            raise ConfigError("--max-model needs --gpu-memory (and --host-memory, --nvme)"
                              if args.gpu_memory is None else "--gpu-memory: got 0; give "
                              "the memory of one device, e.g. 80GB")
        out["max"] = est.max_model(args.gpus, args.gpu_memory, args.host_memory or 0,
                                   args.nvme or 0, nodes=args.nodes, batch=args.batch,
                                   seq_len=seq, state_bytes=state_bytes, tiles=args.tiles)
    if args.probe is not None:
        tokens = args.tokens_per_step or args.batch * seq
        out["efficiency"] = eff.efficiency_from_probe(
            _read_probe(args.probe), tokens, devices_per_node=args.gpus // args.nodes,
            hidden=shape.hidden if shape else None, source=args.probe)
    if args.json:
        _print(json.dumps(_estimate_json(out), indent=2))
    else:
        _print("\n\n".join(_render(k, v) for k, v in out.items()))
    return 0


def _files_bytes(model: str | None) -> int | None:
    """The size of a Hugging Face folder's weight files (what a base read in place reads)."""
    files = list(Path(model).glob("*.safetensors")) if model and Path(model).is_dir() else []
    return sum(f.stat().st_size for f in files) or None


def _read_probe(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--probe {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--probe {path}: expected a JSON object from 'outcore probe --json'")
    return data


def _estimate_json(out: dict[str, Any]) -> dict[str, Any]:
    """``max_params`` at the top level (the documented contract), the rest beside it."""
    data: dict[str, Any] = {}
    if "memory" in out:
        data["memory"] = out["memory"].to_json()
    if "max" in out:
        data.update(out["max"].to_json())
    if "frozen_base" in out:
        data["frozen_base"] = out["frozen_base"].to_json()
    if "efficiency" in out:
        data["efficiency"] = {tier: e.to_json() for tier, e in out["efficiency"].items()}
    return data


def _table(rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def _render(kind: str, value: Any) -> str:
    if kind == "memory":
        m: est.MemoryEstimate = value
        devices = "1 device" if m.devices == 1 else f"{m.devices} devices"
        head = [
            f"model: {m.shape.describe()}",
            f"workload: batch {m.batch} x seq {m.seq_len} per device, {devices}, "
            f"{m.bytes_per_param} bytes/param (mixed-precision Adam)",
            "",
            _table([
                ["model states, whole model", format_bytes(m.model_states)],
                ["activation checkpoints, per device", format_bytes(m.activation_checkpoints)],
                ["activations without checkpointing, per device",
                 format_bytes(m.activations_full)],
                ["working memory, largest operator (MSWM)", format_bytes(m.mswm)],
                ["working memory, activations (AWM)", format_bytes(m.awm)]]),
            ""]
        rows = [["bytes per device", *est.TIERS]] + [
            [name, *(format_bytes(getattr(t, tier)) for tier in est.TIERS)]
            for name, t in m.strategies.items()]
        return "\n".join(head) + "\n" + _table(rows)
    if kind == "max":
        x: est.MaxModel = value
        hw, a = x.hardware, x.assumptions
        rows = [["strategy", "max parameters", "runs out of"]] + [
            [s, format_count(n), x.limited_by[s]] for s, n in x.max_params.items()]
        return "\n".join([
            f"hardware: {hw['gpus']} devices x {format_bytes(hw['gpu_memory'])} on "
            f"{hw['nodes']} node(s); per node {format_bytes(hw['host_memory_per_node'])} host, "
            f"{format_bytes(hw['nvme_per_node'])} NVMe",
            f"assumes {a['bytes_per_param']} bytes/param, batch {a['batch_per_device']} x seq "
            f"{a['seq_len']} per device, GPT shape, usable fraction "
            + ", ".join(f"{t} {f:.0%}" for t, f in a["usable_fraction"].items()),
            "", _table(rows)])
    if kind == "frozen_base":
        b: FrozenBaseEstimate = value
        floor = (f"{b.floor_s:.1f} s at {b.disk_read_GBps:.3g} GB/s" if b.floor_s is not None
                 else "give --probe FILE.json for the disk's rate")
        return "\n".join([
            f"LoRA: {format_count(b.trainable)} adapter parameters over a frozen base of "
            f"{format_count(b.base_params)}, read in place from its files", "",
            _table([["base on disk (read, never written)", format_bytes(b.base_bytes)],
                    ["adapters' state (what outcore stores)", format_bytes(b.adapter_state_bytes)],
                    ["host memory, peak", format_bytes(b.host_bytes)],
                    ["read per step (forward and backward)", format_bytes(b.read_per_step)],
                    ["step floor (disk)", floor]])])
    effs: dict[str, eff.Efficiency] = value
    first = next(iter(effs.values()))
    rows = [["tier", "read GB/s", "params+grads", "optimizer", "both, no overlap",
             "act. checkpoints"]] + [
        [t, f"{e.bandwidth_GBps:.3g}", f"{e.params_grads:.0%}", f"{e.optimizer_states:.0%}",
         f"{e.combined:.0%}",
         "-" if e.activation_checkpoints is None else f"{e.activation_checkpoints:.0%}"]
        for t, e in effs.items()]
    return (f"predicted efficiency at {first.tokens_per_step} tokens/step per device, peak "
            f"{first.peak_TFLOPs:.3g} TFLOP/s (paper sec. 4: ait*bw / (ait*bw + peak))\n\n"
            + _table(rows))


_PROBE_LABELS = {"disk_read_GBps": ("disk read", "GB/s"), "disk_write_GBps": ("disk write", "GB/s"),
                 "host_copy_GBps": ("host copy", "GB/s"),
                 "direct_io": ("disk bypassed page cache", "")}


def _run_probe(args: argparse.Namespace) -> int:
    if not Path(args.path).is_dir():
        raise ConfigError(f"--path {args.path} is not a folder")
    probe = _import_part("outcore.sizing.probe", "the machine probe")
    kwargs: dict[str, Any] = {} if args.size is None else {"size_bytes": args.size}
    if not args.json:
        kwargs["progress"] = True  # progress goes to stderr; a person is waiting ~20 s
    out = probe.measure(args.path, **kwargs).to_json()
    if args.json:
        _print(json.dumps(out, indent=2))
        return 0
    m = out["machine"]
    rows = [["machine", f"{m['cpu']}, {m['cores']} cores" + (
        f", {m['gpu']['name']}" if m["gpu"] else "")]]
    for key, (label, unit) in _PROBE_LABELS.items():
        value = out[key]
        shown = ("yes" if value else "no") if isinstance(value, bool) else f"{value:.3g}"
        rows.append([label, f"{shown} {unit}".rstrip()])
    for name in ("bf16", "fp16", "fp32"):
        how = "native" if out["native"][name] else "emulated"
        rows.append([f"matmul {name} on {out['device']} ({how})",
                     f"{out[f'matmul_{name}_TFLOPs']:.3g} TFLOP/s"])
    rows.append(["dtype auto chooses", out["auto_dtype"]])
    _print(_table(rows))
    return 0


def _run_consolidate(args: argparse.Namespace) -> int:
    if not Path(args.ckpt).exists():
        raise ConfigError(f"checkpoint {args.ckpt} does not exist")
    if not Path(args.ckpt).is_dir():
        raise ConfigError(f"checkpoint {args.ckpt} is a file; give a checkpoint's folder "
                          "(run/checkpoints/step-NNNNNNNN)")
    if not args.out.strip():
        raise ConfigError("OUT is empty; give the file or folder to write the weights to")
    full_weights = _import_part("outcore.io.full_weights", "checkpoints")
    out = full_weights.consolidate(args.ckpt, args.out)
    _print(f"wrote {out} ({format_bytes(out.stat().st_size)})")
    return 0


def _one_line(prog: str, error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{prog}: error: {text}"


def _print(text: str) -> None:
    """Print a command's output. A stdout that cannot take it (``> /dev/full``, a full disk)
    is one line, as a storage error is, not a traceback; a reader that has gone is
    ``main``'s quiet ``BrokenPipeError``. A closed stdout (``>&-``, where ``print`` writes
    nothing and says nothing) is an error too: the command's output was lost."""
    if sys.stdout is None:
        raise StorageError("writing the output failed: standard output is closed")
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise
    except OSError as e:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # (no fd: captured)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit's flush
        raise StorageError(f"writing the output failed: {e.strerror or e}") from None


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR there)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no fd (captured), or no poll here
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the ``outcore`` command and return its exit code (see [Note: the CLI error policy])."""
    as_command, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    prog = f"outcore {command}" if command else "outcore"
    # a warning is one line saying what, as the errors are: no file, line number or source
    formatwarning = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"{prog}: warning: {message}\n"
    try:
        parser = build_parser(with_train_options=command == "train")
        args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand whose options these are not
            where = parser.subcommands.get(args.command, parser) if args.command else parser
            where.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        with terminate_as_interrupt(with_hangup((signal.SIGTERM, signal.SIGUSR1))):
            return int(args.run(args) or 0)
    except SystemExit as e:  # argparse: --help, --version, bad arguments (already printed)
        if isinstance(e.code, str):
            print(_one_line(prog, e), file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (ConfigError, DataError) as e:
        print(_one_line(prog, e), file=sys.stderr)
        return 2
    except OutcoreError as e:
        print(_one_line(prog, e), file=sys.stderr)
        return 1
    except Terminated as e:  # SIGTERM before (or after) the loop: cleaned up as Ctrl-C is
        print(f"{prog}: stopped by {e}; nothing more was saved", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `outcore estimate ... | head`: the reader has gone, quietly
        if not _stdout_gone():
            raise  # another pipe: not the reader of our output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # the shell's code for SIGPIPE
    except (MemoryError, OSError, RuntimeError) as e:  # (after BrokenPipeError, an OSError too)
        if (text := out_of_memory(e)) is None:
            raise
        print(f"{prog}: error: {text}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = formatwarning  # main() called from Python: theirs again
        if as_command and threading.current_thread() is threading.main_thread():
            # the command's work is over: a stop signal now (the interpreter's teardown takes
            # a second) would kill a finished run with 143 or 130, and no word
            for sig in with_hangup((signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)):
                signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    raise SystemExit(main())
