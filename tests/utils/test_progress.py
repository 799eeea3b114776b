"""mpaccel.utils.tqdm: a live bar where the user's terminal can be reached, plain periodic lines
in logs. The modes at size 1 and under mpiexec -n 2/4 in-process; then, for real, a script
under mpiexec -n 2 inside a pseudo-terminal (the bar's carriage returns reach it) and in a pipe
(plain lines)."""

from __future__ import annotations

import fcntl
import io
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
import tty

import pytest

from mpaccel import PartialState, envvars
from mpaccel.errors import ConfigurationError
from mpaccel.testing.launch import mpiexec_command
from mpaccel.utils import progress, tqdm

pytest.importorskip("tqdm", reason="mpaccel.utils.tqdm needs the tqdm package")


def _run_bar(**kwargs) -> str:
    out = io.StringIO()
    for _ in tqdm(range(20), desc="work", file=out, mininterval=0, **kwargs):
        pass
    return out.getvalue()


def test_lines_every_tenth_and_no_carriage_return(comm, monkeypatch):
    monkeypatch.setenv("MPACCEL_PROGRESS", "lines")
    text = _run_bar()
    if comm.rank == 0:
        lines = text.splitlines()
        assert "\r" not in text and len(lines) == 10, text
        assert lines[0].startswith("work:  10% 2/20 [") and lines[-1].startswith("work: 100% 20/20")
    else:
        assert text == ""


def test_lines_by_time_when_the_total_is_unknown(comm, monkeypatch):
    monkeypatch.setenv("MPACCEL_PROGRESS", "lines")
    monkeypatch.setattr(progress, "LINE_EVERY_SECONDS", 0.05)
    out = io.StringIO()
    bar = tqdm((i for i in range(4)), desc="stream", file=out, mininterval=0)
    for _ in bar:
        time.sleep(0.06)
    lines = out.getvalue().splitlines()
    if comm.rank == 0:
        assert len(lines) >= 3 and all(line.startswith("stream: ") for line in lines), lines
        assert lines[-1].startswith("stream: 4it [")
    else:
        assert lines == []


def test_bar_off_and_every_process(comm, monkeypatch):
    monkeypatch.setenv("MPACCEL_PROGRESS", "1")
    bar = _run_bar()
    assert ("\r" in bar and "20/20" in bar) if comm.rank == 0 else bar == ""
    assert _run_bar(disable=True) == ""
    assert "\r" in _run_bar(main_process_only=False)  # every rank draws its own
    monkeypatch.setenv("MPACCEL_PROGRESS", "off")
    assert _run_bar() == ""


def test_a_bad_value_is_an_error_on_every_rank(comm, monkeypatch):
    monkeypatch.setenv("MPACCEL_PROGRESS", "sometimes")
    with pytest.raises(ConfigurationError, match="MPACCEL_PROGRESS='sometimes'"):
        _run_bar()


def test_auto_without_a_terminal_writes_lines(comm, monkeypatch):
    monkeypatch.delenv("MPACCEL_PROGRESS", raising=False)
    PartialState()
    text = _run_bar()  # a StringIO: no terminal, no launcher behind it
    assert ("\r" not in text and len(text.splitlines()) == 10) if comm.rank == 0 else text == ""


SCRIPT = textwrap.dedent("""
    import time
    from mpaccel import PartialState
    from mpaccel.utils import tqdm
    rank = PartialState().process_index
    for _ in tqdm(range(12), desc=f"rank{rank}"):
        time.sleep(0.03)
    print(f"done {rank}", flush=True)
""")


def _launch(n: int, script) -> tuple[list[str], dict[str, str]]:
    argv, extra = mpiexec_command(n)
    env = envvars.child_environment(extra)
    env.pop("MPACCEL_PROGRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return [*argv, sys.executable, str(script)], env


def _in_terminal(argv, env, columns=100, timeout=120) -> str:
    """Run argv with a pseudo-terminal as stdin/stdout/stderr (raw: no \\n -> \\r\\n), as a
    user at a terminal would; what reached the terminal."""
    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has gone
                    break
                if not data:
                    break
                chunks.append(data)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_a_live_bar_reaches_the_terminal_of_mpiexec(tmp_path):
    (tmp_path / "bar.py").write_text(SCRIPT)
    text = _in_terminal(*_launch(2, tmp_path / "bar.py"), columns=100)
    frames = [f for f in text.split("\r") if f.startswith("rank0:")]
    assert len(frames) >= 3, repr(text)  # redrawn in place: carriage returns, not lines
    assert "rank1" not in text and "done 0" in text and "done 1" in text
    # a bar as wide as the launcher's terminal (the rank itself only has a pipe)
    assert any("█" in f and len(f.rstrip("\n")) == 100 for f in frames), frames


@pytest.mark.mpi(size=1)
@pytest.mark.launches
def test_plain_lines_when_mpiexec_writes_to_a_pipe(tmp_path):
    (tmp_path / "bar.py").write_text(SCRIPT)
    argv, env = _launch(2, tmp_path / "bar.py")
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert "\r" not in run.stderr and lines, run.stderr
    assert all(line.startswith("rank0: ") for line in lines), lines
    assert lines[-1].startswith("rank0: 100% 12/12")
