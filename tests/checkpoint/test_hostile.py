"""Checkpoints from untrusted sources (issue 18): each case builds a hostile checkpoint out of a
real one and hands it to load_model_state, Accelerator.load_state and `mpaccel ckpt
ls|verify|export`. Each must end in a CheckpointError naming the file and the tensor or field,
on every rank; no byte from outside the checkpoint directory is read (a file planted outside
holds recognisable bytes that no tensor and no export may carry); memory stays bounded; nothing
hangs; and where the error comes before any byte is read, the live model is as it was.
The bodies run at size 1 and under mpiexec -n 2 / -n 4."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import zlib
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import xxhash

from mpaccel import Accelerator
from mpaccel.checkpoint import CheckpointError, load_model_state
from mpaccel.checkpoint.format import INDEX_DIGEST, index_digest
from mpaccel.testing import reset_state
from tests.checkpoint.test_cli import DEADLINE, Commands

SECRET = b"SECRET!!"  # what the file planted outside the checkpoint directory holds
MEMORY_BOUND = 200 << 20  # bytes a refused load may add to a process's peak memory


# --- measuring -------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise LookupError(field)


@contextlib.contextmanager
def _bounded():
    """The block must end within DEADLINE seconds (SIGALRM interrupts a blocking open, which
    Python then turns into the handler's exception) and raise its peak memory by less than
    MEMORY_BOUND (VmHWM, reset through /proc/self/clear_refs)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {DEADLINE} s: it hangs")

    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        growth = _status("VmHWM") - before
        assert growth < MEMORY_BOUND, f"peak memory grew by {growth >> 20} MiB"


@pytest.fixture(scope="module")
def commands(comm):
    """The command driver, on rank 0 (None elsewhere)."""
    driver = Commands() if comm.rank == 0 else None
    yield driver
    if driver is not None:
        driver.close()


# --- building hostile checkpoints ------------------------------------------------------------


def _index(directory: Path, stem: str) -> dict:
    return json.loads((directory / f"{stem}.index.json").read_text())


def _commit(directory: Path, stem: str, index: dict, text: Callable[[str], str] | None = None):
    """Write `index` with a digest that matches it, as an attacker would: the digest catches
    corruption, it is no signature."""
    index = {k: v for k, v in index.items() if k != INDEX_DIGEST}
    index[INDEX_DIGEST] = index_digest(index)
    body = json.dumps(index, indent=1)
    (directory / f"{stem}.index.json").write_text(text(body) if text else body)


def _first(index: dict) -> tuple[str, dict]:
    """The first shard's first non-empty tensor, in file order."""
    shard = index["shards"][0]
    entries = [(e["offset"], k) for k, e in index["tensors"].items()
               if e["file"] == shard and e["nbytes"]]
    key = min(entries)[1]
    return key, index["tensors"][key]


def _marker(nbytes: int) -> bytes:
    return (SECRET * (nbytes // len(SECRET) + 1))[:nbytes]


def _plant(directory: Path, stem: str, outside: Path) -> tuple[Path, dict[str, str]]:
    """outside/secret.h5: a copy of the first shard whose tensors' bytes are SECRET. Returns it
    and {key: xxh3 of its bytes there}, for an index that would then load it without a
    complaint."""
    index = _index(directory, stem)
    shard = index["shards"][0]
    secret = outside / "secret.h5"
    shutil.copyfile(directory / shard, secret)
    sums = {}
    with open(secret, "r+b") as f:
        for key, entry in index["tensors"].items():
            if entry["file"] == shard and entry["nbytes"]:
                f.seek(entry["offset"])
                f.write(_marker(entry["nbytes"]))
                sums[key] = xxhash.xxh3_64(_marker(entry["nbytes"])).hexdigest()
    return secret, sums


def _redirect(directory: Path, stem: str, outside: Path, name_of: Callable[[Path], str]):
    """The index names the planted file (as `name_of(path)`) for the first shard's tensors."""
    secret, sums = _plant(directory, stem, outside)
    index = _index(directory, stem)
    shard, name = index["shards"][0], name_of(secret)
    for key, entry in index["tensors"].items():
        if entry["file"] == shard:
            entry["file"] = name
            entry["xxh3"] = sums.get(key, entry["xxh3"])
    index["shards"] = [name if s == shard else s for s in index["shards"]]
    index["file_sizes"][name] = secret.stat().st_size
    _commit(directory, stem, index)


def _traversal(d, stem, outside):
    _redirect(d, stem, outside, lambda p: f"../{p.parent.name}/{p.name}")


def _absolute(d, stem, outside):
    _redirect(d, stem, outside, lambda p: str(p.resolve()))


def _raw_text_file(d, stem, outside):
    index = _index(d, stem)
    key, entry = _first(index)
    (outside / "secret.txt").write_bytes(_marker(4096))
    entry.update(file="../outside/secret.txt", offset=0,
                 xxh3=xxhash.xxh3_64(_marker(entry["nbytes"])).hexdigest())
    index["shards"].append("../outside/secret.txt")
    index["file_sizes"]["../outside/secret.txt"] = 4096
    _commit(d, stem, index)


def _symlinked_shard(d, stem, outside):
    secret, sums = _plant(d, stem, outside)
    index = _index(d, stem)
    shard = index["shards"][0]
    for key, value in sums.items():
        index["tensors"][key]["xxh3"] = value
    _commit(d, stem, index)
    (d / shard).unlink()
    (d / shard).symlink_to(secret)


def _rewrite(d: Path, stem: str, make: Callable[[h5py.Group, str, dict], None]):
    """Replace the first tensor's dataset with what `make(group, name, entry)` creates; the
    index drops its offset (HDF5 is asked where the data is) and takes the file's new size."""
    index = _index(d, stem)
    key, entry = _first(index)
    component, name = key.split("/")
    with h5py.File(d / entry["file"], "r+") as f:
        attrs = dict(f[key].attrs)
        del f[key]
        make(f[component], name, entry)
        if name in f[component] and f[component].get(name, getlink=True).__class__ is h5py.HardLink:
            f[key].attrs.update(attrs)
    entry.pop("offset", None)
    index["file_sizes"][entry["file"]] = (d / entry["file"]).stat().st_size
    _commit(d, stem, index)
    return index, key, entry


def _with_secret_sum(d, stem, outside, make):
    """_rewrite, with the index's checksum that of the planted bytes (so that only the
    checks of the layout stand between the load and them)."""
    secret, sums = _plant(d, stem, outside)
    index, key, entry = _rewrite(d, stem, lambda g, n, e: make(g, n, e, secret))
    entry["xxh3"] = sums[key]
    _commit(d, stem, index)


def _virtual(d, stem, outside):
    def make(group, name, entry, secret):
        key = f"{group.name.strip('/')}/{name}"
        layout = h5py.VirtualLayout(shape=tuple(entry["shape"]), dtype=np.float32)
        layout[...] = h5py.VirtualSource(str(secret), key, shape=tuple(entry["shape"]))
        group.create_virtual_dataset(name, layout)

    _with_secret_sum(d, stem, outside, make)


def _external_storage(d, stem, outside):
    def make(group, name, entry, secret):
        raw = outside / "secret.bin"
        raw.write_bytes(_marker(entry["nbytes"]))
        group.create_dataset(name, shape=tuple(entry["shape"]), dtype=np.float32,
                             external=[(str(raw), 0, entry["nbytes"])])

    _with_secret_sum(d, stem, outside, make)


def _external_link(d, stem, outside):
    def make(group, name, entry, secret):
        group[name] = h5py.ExternalLink(str(secret), f"{group.name}/{name}")

    _with_secret_sum(d, stem, outside, make)


def _soft_link(d, stem, outside):
    def make(group, name, entry, secret):
        group.file.create_dataset("hidden", data=np.frombuffer(
            _marker(entry["nbytes"]), np.float32).reshape(entry["shape"]))
        group[name] = h5py.SoftLink("/hidden")

    _with_secret_sum(d, stem, outside, make)


def _replace_shard(d: Path, stem: str, make: Callable[[Path], None]):
    shard = d / _index(d, stem)["shards"][0]
    shard.unlink()
    make(shard)


def _fifo_shard(d, stem, outside):
    _replace_shard(d, stem, os.mkfifo)


def _fifo_index(d, stem, outside):
    (d / f"{stem}.index.json").unlink()
    os.mkfifo(d / f"{stem}.index.json")


def _directory_shard(d, stem, outside):
    _replace_shard(d, stem, os.mkdir)


def _socket_shard(d, stem, outside):
    def make(path):
        server = socket.socket(socket.AF_UNIX)
        here = os.getcwd()
        os.chdir(path.parent)  # a socket's path may not be longer than ~108 bytes
        try:
            server.bind(path.name)
        finally:
            os.chdir(here)
        _SOCKETS.append(server)

    _replace_shard(d, stem, make)


_SOCKETS: list[socket.socket] = []
_BASELINE: list[int] = []  # peak memory of `mpaccel ckpt verify` on a good checkpoint


def _device_shard(d, stem, outside):
    _replace_shard(d, stem, lambda p: os.mknod(p, 0o600 | 0o020000, os.makedev(1, 5)))


def _symlinked_index(d, stem, outside):
    shutil.move(d / f"{stem}.index.json", outside / "index.json")
    (d / f"{stem}.index.json").symlink_to(outside / "index.json")


def _dev_zero(d, stem, outside):
    index = _index(d, stem)
    key, entry = _first(index)
    entry.update(file="/dev/zero", shape=[1 << 28], nbytes=1 << 30, offset=0)
    index["shards"].append("/dev/zero")
    index["file_sizes"]["/dev/zero"] = 1 << 40
    _commit(d, stem, index)


def _edit(change: Callable[[dict], None], text: Callable[[str], str] | None = None):
    def mutate(d, stem, outside):
        index = _index(d, stem)
        change(index)
        _commit(d, stem, index, text)

    return mutate


def _set_first(**fields):
    return _edit(lambda index: _first(index)[1].update(fields))


def _truncated_index(d, stem, outside):
    path = d / f"{stem}.index.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _json_list(d, stem, outside):
    (d / f"{stem}.index.json").write_text(json.dumps([_index(d, stem)]))


def _component(index: dict) -> str:
    return "model" if "model" in index["components"] else "model_0"


def _nested(levels: int):
    def text(body: str) -> str:
        return body.replace('"@deep@"', "[" * levels + "]" * levels)

    return _edit(lambda index: index["components"][_component(index)].update(x="@deep@"), text)


def _huge_string(d, stem, outside):
    index = _index(d, stem)
    index["components"][_component(index)]["note"] = "@huge@"
    _commit(d, stem, index)
    path = d / f"{stem}.index.json"
    head, tail = path.read_text().split('"@huge@"')
    with open(path, "w") as f:
        f.write(head + '"')
        for _ in range(100):
            f.write("a" * 1_000_000)
        f.write('"' + tail)


def _oversized_index(d, stem, outside):
    with open(d / f"{stem}.index.json", "r+") as f:
        f.truncate((1 << 30) + 1)  # sparse: refused by its size, never read


def _never_written_chunks(d, stem, outside):
    def make(group, name, entry):
        group.create_dataset(name, shape=(1 << 28,), dtype=np.float32, chunks=(1 << 20,))

    index, key, entry = _rewrite(d, stem, make)
    _resize(d, stem, index, entry)


def _resize(d, stem, index, entry):
    entry.update(shape=[1 << 28], nbytes=1 << 30)
    _commit(d, stem, index)
    assert (d / entry["file"]).stat().st_size < (2 << 20)


def _gzip_bomb(d, stem, outside):
    def make(group, name, entry):
        ds = group.create_dataset(name, shape=(1 << 28,), dtype=np.float32, chunks=(1 << 20,),
                                  compression="gzip")
        zeros = zlib.compress(bytes(4 << 20), 9)
        for i in range(256):
            ds.id.write_direct_chunk((i << 20,), zeros)

    index, key, entry = _rewrite(d, stem, make)
    digest = xxhash.xxh3_64()
    for _ in range(256):
        digest.update(bytes(4 << 20))
    entry["xxh3"] = digest.hexdigest()
    _resize(d, stem, index, entry)


def _filled(d, stem, outside):
    _rewrite(d, stem, lambda g, n, e: g.create_dataset(
        n, shape=tuple(e["shape"]), dtype=np.float32, chunks=True, fillvalue=1.0))


def _extensible(d, stem, outside):
    def make(group, name, entry):
        group.create_dataset(name, data=np.zeros(entry["shape"], np.float32), chunks=True,
                             maxshape=(None,) * len(entry["shape"]))

    _rewrite(d, stem, make)


def _strings(d, stem, outside):
    def make(group, name, entry):
        group.create_dataset(name, data=np.array([b"a"] * entry["shape"][0], dtype=object),
                             dtype=h5py.string_dtype())

    index, key, entry = _rewrite(d, stem, make)


def _truncated(d, stem, outside):
    shard = d / _index(d, stem)["shards"][0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)


def _overlap(d, stem, outside):
    def change(index):
        files: dict[str, list[dict]] = {}
        for entry in index["tensors"].values():
            if entry["nbytes"]:
                files.setdefault(entry["file"], []).append(entry)
        first, second = sorted(max(files.values(), key=len), key=lambda e: e["offset"])[:2]
        second["offset"] = first["offset"]

    _edit(change)(d, stem, outside)


def _swapped(d, stem, outside):
    """A shard of another checkpoint of the same model (trained on), under this one's name."""
    index = _index(d, stem)
    other = next(p for p in d.parent.iterdir() if p.name.startswith(f"other-{stem}"))
    theirs = _index(other, stem)
    shutil.copyfile(other / theirs["shards"][0], d / index["shards"][0])


@dataclasses.dataclass
class Case:
    mutate: Callable[[Path, str, Path], None]
    expect: str  # a regex the error matches
    field: bool = True  # the error names the tensor or the field (not the file alone)
    index_level: bool = True  # `ckpt ls`, which reads the index only, refuses it too
    before_read: bool = True  # refused before any byte is read: the live model is unchanged
    every_rank: bool = True  # every rank finds it (else the ranks of a node share checksums)


_NOT_PLAIN = "expected a plain file name in the checkpoint directory"
CASES = {
    "path traversal": Case(_traversal, r"\['file'\] is '\.\./outside/secret\.h5': " + _NOT_PLAIN),
    "absolute path": Case(_absolute, r"\['file'\] is '/.*secret\.h5': " + _NOT_PLAIN),
    "raw text file outside": Case(_raw_text_file, r"is '\.\./outside/secret\.txt': " + _NOT_PLAIN),
    "index naming /dev/zero": Case(_dev_zero, r"is '/dev/zero': " + _NOT_PLAIN),
    "symlinked shard": Case(_symlinked_shard, r"\.h5' is a symbolic link, not a regular file",
                            index_level=False),
    "symlinked index": Case(_symlinked_index, r"index\.json' is a symbolic link", field=False),
    "virtual dataset": Case(_virtual, r"is a virtual dataset", index_level=False),
    "external storage": Case(_external_storage, r"is stored in external files",
                             index_level=False),
    "external link": Case(_external_link, r"is an external link \(to '/.*secret\.h5'",
                          index_level=False),
    "soft link": Case(_soft_link, r"is a soft link \(to '/hidden'\)", index_level=False),
    "FIFO shard": Case(_fifo_shard, r"\.h5' is a FIFO, not a regular file", index_level=False),
    "FIFO index": Case(_fifo_index, r"index\.json' is a FIFO, not a regular file", field=False),
    "directory shard": Case(_directory_shard, r"is a directory, not a regular file",
                            index_level=False),
    "socket shard": Case(_socket_shard, r"is a socket, not a regular file", index_level=False),
    "device shard": Case(_device_shard, r"is a character device, not a regular file",
                         index_level=False),
    "index is a JSON list": Case(_json_list, r"is not an mpaccel checkpoint index", field=False),
    "components is a list": Case(_edit(lambda i: i.update(components=[i["components"]])),
                                 r"components is \[.*: expected a dict"),
    "model state is a list": Case(
        _edit(lambda i: i["components"].update({_component(i): [1, 2]})),
        r"components\['model(_0)?'\] is \[1, 2\]: expected the object's state_dict"),
    "NaN size": Case(_set_first(nbytes=float("nan")), r"\['nbytes'\] is nan: expected an integer"),
    "NaN offset": Case(_set_first(offset=float("nan")),
                       r"\['offset'\] is nan: expected an integer"),
    "infinite file size": Case(
        _edit(lambda i: i["file_sizes"].update({k: float("inf") for k in i["file_sizes"]})),
        r"file_sizes\['.*'\] is inf: expected an integer"),
    "truncated index": Case(_truncated_index, r"index\.json' is not valid JSON", field=False),
    "5000-digit integer": Case(
        _edit(lambda i: _first(i)[1].update(offset="@big@"),
              lambda body: body.replace('"@big@"', "9" * 5000)),
        r"a number of more than 4300 digits \(at byte \d+\)", field=False),
    "nested 600 deep": Case(_nested(600), r"nested more than 200 levels deep", field=False),
    "nested 200,000 deep": Case(_nested(200_000), r"nested more than 200 levels deep",
                                field=False),
    "1 TiB void scalar": Case(
        _edit(lambda i: i["components"][_component(i)].update(
            x={"__npscalar__": "V8", "value": 1 << 40})),
        r"\['__npscalar__'\] is 'V8': not a numpy scalar type mpaccel stores"),
    "100 MB string": Case(_huge_string, r"a string of more than 16777216 bytes", field=False),
    "index of more than 1 GiB": Case(_oversized_index, r"more than an index may", field=False),
    "huge declared shape": Case(_set_first(shape=[1 << 28], nbytes=1 << 30),
                                r"\['offset'\] is \d+: 1073741824 bytes from there end past"),
    "shape disagrees with size": Case(_set_first(shape=[1 << 28]),
                                      r"\['nbytes'\] is \d+: float32 \[268435456\] holds"),
    "1 TiB dtype": Case(_set_first(dtype="numpy.V1099511627776"),
                        r"\['dtype'\] is 'numpy.V1099511627776': not a dtype mpaccel stores"),
    "overlapping tensors": Case(_overlap, r"\['offset'\] is \d+: its bytes overlap those of"),
    "shard name not listed": Case(_edit(lambda i: i.update(shards=[])),
                                  r"\['file'\] is '.*', which is not among this part's files"),
    "tensor outside any component": Case(
        _edit(lambda i: i["tensors"].update({"nowhere/x": _first(i)[1]})),
        r"tensors\['nowhere/x'\] is not a tensor of a component of the index"),
    "never-written chunks": Case(_never_written_chunks, r"has 0 of its 256 chunks written",
                                 index_level=False),
    "gzip bomb": Case(_gzip_bomb, r"is stored through HDF5 filters \['deflate'\]",
                      index_level=False),
    "fill value": Case(_filled, r"has a fill value", index_level=False),
    "extensible dataset": Case(_extensible, r"has shape .* \(at most \(None", index_level=False),
    "string dataset": Case(_strings, r"is of a variable-length or reference type",
                           index_level=False),
    "truncated shard": Case(_truncated, r"cannot open checkpoint file .* in HDF5", field=False,
                            index_level=False),
    "swapped shard": Case(_swapped, r"checksum mismatch for '.*' in '.*\.h5'", index_level=False,
                          before_read=False, every_rank=False),
}


# --- the test --------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _tensors(tree) -> list[torch.Tensor]:
    if not isinstance(tree, dict):
        return []
    return [v for v in tree.values() if isinstance(v, torch.Tensor)]


def _carries_secret(tensor: torch.Tensor) -> bool:
    return SECRET[:4] in tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()


# What a case checks is the reader's refusal of one file, which does not depend on the world
# size: each runs in the size-1 pass. Under mpiexec the 43 cases took 33 s of the -n 2 stage
# alone (110 s beside the size-1 pass) and 28 s of the -n 4 stage (a declared 1 TiB tensor, a
# 100 MB string or a gzip bomb 4-17 s each), to show again what one process showed. There only
# these run, one per kind of failure (an index field, a shard's bytes, a link out of the
# directory, a checkpoint another save left, which only some ranks may detect), and every rank
# agreeing on the refusal shows at 2 and 4 through them.
AT_EVERY_SIZE = {"truncated shard", "symlinked shard", "absolute path", "swapped shard",
                 "tensor outside any component"}


@pytest.mark.parametrize("name", [
    name if name in AT_EVERY_SIZE else pytest.param(name, marks=pytest.mark.mpi(size=1))
    for name in sorted(CASES)
])
def test_a_hostile_checkpoint_is_refused_everywhere(name, mpi_tmp_path, comm, commands):
    case = CASES[name]
    if name == "device shard" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    reset_state()
    acc = Accelerator()
    model = acc.prepare(_model())
    opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    root, outside = mpi_tmp_path / "ckpts", mpi_tmp_path / "outside"
    acc.save_model(model, root / "model", safe_serialization=False)
    acc.save_state(root / "state")
    if name == "swapped shard":  # the same model, one step further
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        acc.save_model(model, root / "other-model", safe_serialization=False)
        acc.save_state(root / "other-state")
    acc.wait_for_everyone()
    if acc.is_main_process:
        if not _BASELINE:  # the commands' peak memory on a good checkpoint
            code, _, err, peak = commands.run("verify", str(root / "model"))
            assert code == 0, err
            _BASELINE.append(peak)
        outside.mkdir()
        for stem in ("model", "state"):
            case.mutate(root / stem, stem, outside)
    acc.wait_for_everyone()
    with torch.no_grad():  # the live model now differs from both checkpoints
        for p in model.parameters():
            p.add_(1.0)
    live = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    def check(exc: BaseException, directory: Path) -> str:
        text = str(exc)
        assert re.search(case.expect, text), text
        assert str(directory) in text, text  # the file: the directory's index or a shard of it
        if case.field:
            assert re.search(r"'(model|model_0|optimizer_0|nowhere)/[^']+'|components|file_sizes",
                             text), text
        return text

    with _bounded(), pytest.raises(CheckpointError) as info:
        state = load_model_state(root / "model")
        assert not any(_carries_secret(t) for t in _tensors(state))
    check(info.value, root / "model")

    with _bounded(), pytest.raises(CheckpointError) as info:
        acc.load_state(root / "state")
    check(info.value, root / "state")
    if case.every_rank:
        assert info.value.failed_ranks == list(range(comm.size)), info.value.failed_ranks
    now = acc.unwrap_model(model).state_dict()
    assert not any(_carries_secret(t) for t in now.values())
    if case.before_read:
        assert all(torch.equal(now[k], v) for k, v in live.items()), "the live model changed"

    if acc.is_main_process:
        _check_commands(commands, case, root / "model", mpi_tmp_path / "export.safetensors")
    acc.wait_for_everyone()
    for server in _SOCKETS:
        server.close()
    _SOCKETS.clear()


def _check_commands(commands: Commands, case: Case, directory: Path, export: Path) -> None:
    """`mpaccel ckpt ls|verify|export`: one line naming the file and what is wrong (then its
    HINT), exit 1, no traceback, no planted byte in what it writes, bounded memory."""
    baseline = _BASELINE[0]
    for command in ("ls", "verify", "export"):
        output = ["--output", str(export)] if command == "export" else []
        args = [command, str(directory), *output]
        code, out, err, peak = commands.run(*args)
        assert "Traceback" not in err, err
        assert peak - baseline < MEMORY_BOUND, f"{command}: {(peak - baseline) >> 20} MiB more"
        if command == "ls" and not case.index_level:
            assert code == 0, err  # it reads the index only, and lists what it says
            continue
        assert code == 1, (command, code, out, err)
        first = err.splitlines()[0]
        assert str(directory) in first and re.search(case.expect, first), (command, err)
    if export.exists():
        assert SECRET not in export.read_bytes()
        export.unlink()


def test_a_state_nested_as_deep_as_a_save_allows_loads_back(mpi_tmp_path, comm):
    """Readers refuse indexes nested more than 200 levels deep; saves refuse states nested more
    than 64 levels (3 JSON levels each at most), so whatever saves, loads."""

    class Deep:
        def __init__(self, levels):
            self.levels, self.loaded = levels, None

        def state_dict(self):
            tree = {0: torch.ones(1), "x": 1.5}
            for _ in range(self.levels - 1):
                tree = {1: tree}
            return tree

        def load_state_dict(self, state):
            self.loaded = state

    reset_state()
    acc = Accelerator()
    deep = Deep(64)
    acc.register_for_checkpointing(deep)
    acc.save_state(mpi_tmp_path / "deep")
    acc.load_state(mpi_tmp_path / "deep")
    tree = deep.loaded
    for _ in range(63):
        tree = tree[1]
    assert torch.equal(tree[0], torch.ones(1))
    acc.register_for_checkpointing(Deep(66))
    with pytest.raises(CheckpointError, match="nested more than 64 levels deep"):
        acc.save_state(mpi_tmp_path / "deeper")


def _random_json(rng, depth=0):
    """A random JSON value whose strings hold what the scanner must see through: quotes,
    backslashes, brackets, digits."""
    kind = rng.randrange(6 if depth < 12 else 3)
    if kind == 0:
        return rng.randrange(-10**rng.randrange(1, 9), 10**rng.randrange(1, 9))
    if kind == 1:
        return _text(rng)
    if kind == 2:
        return rng.choice([None, True, 1.5])
    if kind in (3, 4):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_text(rng): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _text(rng):
    return "".join(rng.choice('ab"\\[]{}0123456789\u00e9\n') for _ in range(rng.randrange(12)))


def _measure(value, depth=1):
    """(nesting depth, longest string as written, most digits in a number) of a JSON value."""
    if isinstance(value, list):
        found = [_measure(v, depth + 1) for v in value]
    elif isinstance(value, dict):
        found = [_measure(v, depth + 1) for v in value.values()]
        found += [(0, len(json.dumps(k)) - 2, 0) for k in value]
    elif isinstance(value, str):
        return 0, len(json.dumps(value)) - 2, 0
    elif isinstance(value, int) and not isinstance(value, bool):
        return 0, 0, len(str(abs(value)))
    else:
        return 0, 0, 0
    deepest = max([depth, *(f[0] for f in found)])
    return (deepest, *(max((f[i] for f in found), default=0) for i in (1, 2)))


@pytest.mark.mpi(size=1)  # no collective: the scanner of one process against json.loads
def test_the_index_scanner_agrees_with_the_json_it_scans(monkeypatch):
    """On random JSON cut into random chunks, the scanner refuses exactly the documents nested
    too deep or holding a string or number too long (small limits, to hit them often)."""
    import random

    from mpaccel.checkpoint import index_check

    monkeypatch.setattr(index_check, "MAX_DEPTH", 4)
    monkeypatch.setattr(index_check, "MAX_STRING_BYTES", 14)
    monkeypatch.setattr(index_check, "MAX_INT_DIGITS", 6)
    monkeypatch.setattr(index_check, "_LONG_NUMBER", b"0" * 7)
    rng = random.Random(18)
    verdicts = set()
    for _ in range(3000):
        value = _random_json(rng)
        text = json.dumps(value).encode()
        depth, longest, digits = _measure(value)
        expected = depth <= 4 and longest <= 14 and digits <= 6
        scanner = index_check.IndexScanner("t")
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(4))))
        try:
            for start, end in zip([0, *cuts], [*cuts, len(text)]):
                scanner.feed(text[start:end])
            accepted = True
        except CheckpointError:
            accepted = False
        assert accepted == expected, (text, depth, longest, digits, cuts)
        verdicts.add(expected)
    assert verdicts == {True, False}
