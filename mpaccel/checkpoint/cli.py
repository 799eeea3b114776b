"""`mpaccel ckpt ls|verify|export DIR`: inspect, check and convert checkpoints (one process)."""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

from ..errors import CheckpointError
from .format import dataset_name, unflatten
from .index import CheckpointIndex
from .reader import CheckpointReader
from .sharded.load import read_full, verify_sliced

STEMS = ("state", "model", "sharded")


def _stems(directory: str, stem: str | None) -> list[str]:
    """The stems to read: `stem`, or every committed index there (a training checkpoint of a
    fully sharded model has two: state and sharded)."""
    # lexists: an index that is a link or a FIFO is there, and CheckpointReader says what is
    # wrong with it
    stems = [stem] if stem else [s for s in STEMS
                                 if os.path.lexists(os.path.join(directory, f"{s}.index.json"))]
    if not stems:
        raise CheckpointError(
            f"{directory!r} holds no committed checkpoint (no state.index.json, "
            "model.index.json or sharded.index.json)",
            "an interrupted save leaves no index; point at a complete checkpoint.",
        )
    return stems


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def run_ls(args: argparse.Namespace) -> int:
    for stem in _stems(args.directory, args.stem):
        _list(args, stem)
    return 0


def _list(args: argparse.Namespace, stem: str) -> None:
    with CheckpointReader(args.directory, stem) as reader:
        index = reader.index
        created = index.created if index.created is not None else "an unrecorded time"
        print(f"{args.directory}: {reader.stem} checkpoint, format {index.format_version}, "
              f"written by {index.world_size} process(es) at {created}")
        # shared tensors, then each rank's own (RNG states...), named "rank R: key"
        entries = sorted(index.tensors.items())
        for rank, part in enumerate(index.per_rank):
            entries += [(f"rank {rank}: {key}", e) for key, e in sorted(part.tensors.items())]
        rows = [("tensor", "dtype", "shape", "size", "file")]
        for key, entry in entries:
            rows.append((key, entry.dtype, "x".join(map(str, entry.shape)) or "scalar",
                         _size(entry.nbytes), entry.file))
        sliced = sorted(index.sliced.items())  # sharded checkpoints: global shapes
        for key, tensor in sliced:
            files = {piece.file for piece in tensor.slices}
            rows.append((key, tensor.dtype, "x".join(map(str, tensor.shape)) or "scalar",
                         _size(sum(piece.nbytes for piece in tensor.slices)),
                         f"{len(tensor.slices)} slice(s) "
                         + ", ".join(f"{p.start}:{p.stop}" for p in tensor.slices[:4])
                         + (" ..." if len(tensor.slices) > 4 else "")
                         + f" in {len(files)} file(s)"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for line in _tied(index):
            print(line)
        total = sum(entry.nbytes for entry in index.tensors.values())
        shards = len(index.shards)
        summary = f"{len(index.tensors)} tensors, {_size(total)} in {shards} shard(s)"
        if index.per_rank:
            own = sum(len(part.tensors) for part in index.per_rank)
            summary += f"; {own} per-rank tensors in {len(index.per_rank)} per-rank file(s)"
        if sliced:
            total = sum(p.nbytes for _, e in sliced for p in e.slices)
            summary = (f"{len(sliced)} sharded tensors, {_size(total)} in {shards} file(s), "
                       "rows along dimension 0")
        print(summary)


def _tied(index: CheckpointIndex) -> list[str]:
    """Lines naming the datasets stored once for several keys (tied weights), with the keys."""
    lines = []
    for component, document in index.components.items():
        uses: collections.Counter[str] = collections.Counter()
        tree = unflatten(document, lambda name, kind, uses=uses: uses.update([name]) or name)
        for name, count in uses.items():
            if count < 2:
                continue
            keys = [str(k) for k, v in tree.items() if v == name] if isinstance(tree, dict) else []
            which = ", ".join(keys) if len(keys) == count else f"{count} keys"
            lines.append(f"stored once for several keys: {dataset_name(component, name)} ({which})")
    return lines


def run_verify(args: argparse.Namespace) -> int:
    count, problems = 0, []
    for stem in _stems(args.directory, args.stem):
        with CheckpointReader(args.directory, stem) as reader:
            problems += reader.verify()
            count += sum(1 for _ in reader.index.entries())
            sliced, more = verify_sliced(reader)
            count, problems = count + sliced, problems + more
    for problem in dict.fromkeys(problems):  # a file refused as a whole: said once
        print(problem, file=sys.stderr)
    print(f"{args.directory}: {count - len(problems)} of {count} tensors verified"
          + ("" if not problems else f", {len(problems)} FAILED"))
    return 1 if problems else 0


def run_export(args: argparse.Namespace) -> int:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(
            "export to safetensors needs the safetensors package",
            "pip install 'mpaccel[safetensors]'",
        ) from None
    stems = _stems(args.directory, args.stem)
    component = args.component or ("model_0" if stems[0] == "state" else "model")
    for stem in stems:  # the index that holds it (a training checkpoint's model may be sharded)
        with CheckpointReader(args.directory, stem) as reader:
            if component in reader.index.components:
                break
    with CheckpointReader(args.directory, stem) as reader:
        if reader.index.is_sharded:  # a sharded checkpoint: its slices joined
            tree = read_full(args.directory, reader.stem, component)
        else:
            tree = reader.component(component)
    if not isinstance(tree, dict):
        raise CheckpointError(
            f"{component!r} of {args.directory!r} is not a state_dict (it is a "
            f"{type(tree).__name__})",
            "safetensors files hold a model's state_dict; name another --component.",
        )
    tensors = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(tree):
        others = [str(k) for k in tree if k not in tensors]
        shown = ", ".join(repr(k) for k in others[:5]) + (" ..." if len(others) > 5 else "")
        raise CheckpointError(
            f"{component!r} is not a flat state_dict of tensors: {len(others)} key(s) hold "
            f"other values ({shown})",
            "safetensors files hold torch tensors only; a module's get_extra_state() (an "
            "'_extra_state' key) and numpy arrays cannot be exported: load the checkpoint with "
            "mpaccel instead.",
        )
    out = args.output or os.path.join(args.directory, f"{component}.safetensors")
    # tied weights load as one tensor under several keys; safetensors refuses tensors that share
    # memory, and a strict load_state_dict needs every key: each key gets its own copy
    seen: set[int] = set()
    flat = {}
    for k, v in tensors.items():
        memory = v.untyped_storage().data_ptr()
        flat[k] = v.clone() if memory and memory in seen else v.contiguous()
        seen.add(memory)
    save_file(flat, out, metadata={"format": "pt"})
    print(f"wrote {len(tensors)} tensors of {component!r} to {out}")
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect, verify and export checkpoints")
    actions = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    for name, run, text in (
        ("ls", run_ls, "list tensors: dtype, shape, size, shard"),
        ("verify", run_verify, "check every tensor's checksum (exit 1 on any mismatch)"),
        ("export", run_export, "write a model's weights as a safetensors file"),
    ):
        parser = actions.add_parser(name, help=text, description=text)
        parser.add_argument("directory")
        parser.add_argument("--stem", choices=STEMS,
                            help="which index (default: state, model, sharded)")
        if name == "export":
            parser.add_argument("--to", choices=["safetensors"], default="safetensors")
            parser.add_argument("--component",
                                help="model_0 (save_state), model (save_model, sharded)")
            parser.add_argument("--output", help="default: DIR/COMPONENT.safetensors")
        parser.set_defaults(run=_guarded(run))


def _guarded(run):
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
        except BrokenPipeError:
            raise  # `mpaccel ckpt ls | head`: main() ends quietly
        except Exception as exc:  # a file this one does not expect: one line, never a traceback
            text = " ".join(str(exc).split())
            print(f"error: {args.directory!r}: {type(exc).__name__}: {text}", file=sys.stderr)
        return 1

    return wrapper
