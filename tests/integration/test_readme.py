"""The README runs as written, in a new shell: its client example, and every command of its
``sh`` blocks (issue 17: a new user's first hour).

"A new shell" is ``bash`` with a bare PATH in a fresh folder that links to the repository's
files; it runs the README's own set-up lines (``source .venv/bin/activate``) first, so a
README that forgets them fails here as it would for a new user. Only addresses are
rewritten, so the servers started here meet nobody else's: the ipc:// socket, the admin
and tcp ports, torchrun's rendezvous port, and ``0.0.0.0`` (tests bind loopback only).
Each server must answer a ping, drain on SIGTERM to its leader, and exit 0.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import free_port, sync_ping

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def readme_example() -> str:
    """The first ```python block of README.md."""
    m = re.search(r"^```python\n(.*?)^```", README, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def readme_commands() -> list[str]:
    """Every command of the README's ```sh blocks: continuations joined, comments dropped."""
    cmds = []
    for block in re.findall(r"^```sh\n(.*?)^```", README, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            cmd = re.split(r"\s#\s|^#", line, maxsplit=1)[0].strip()
            if cmd:
                cmds.append(cmd)
    return cmds


def new_shell(tmp_path: Path) -> tuple[Path, dict]:
    """A fresh folder showing the repository's files, and the environment of a new login shell."""
    home = tmp_path / "checkout"
    home.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("mmsched.toml", "keys", "client-keys"):
            (home / entry.name).symlink_to(entry)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "LANG": os.environ.get("LANG", "C.UTF-8"), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    return home, env


def set_up() -> str:
    """The README's own lines that prepare a shell (``source …``), joined; "true" when none."""
    return " && ".join(c for c in readme_commands() if c.startswith("source ")) or "true"


def shell(cmd: str, cwd: Path, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", f"{set_up()} && exec env {cmd}"], cwd=cwd, env=env,
                            start_new_session=True, text=True, **kw)


def container_engine() -> bool:
    """What ``make image`` needs, found as the Makefile looks for it: a docker daemon, else podman."""
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return True
    return shutil.which("podman") is not None


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def leader_pid(root: int) -> int:
    """The process that decides the stop: rank 0 of a group, else the mmsched process itself."""
    procs = []
    for p in _descendants(root):
        try:
            environ = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in environ:
            return p
        if any(b"mmsched" in a for a in cmdline) and b"serve" in cmdline and b"python" in cmdline[0]:
            procs.append(p)
    assert procs, f"no mmsched process under {root}"
    return procs[0]


def test_readme_example_runs(start_server, tmp_path):
    srv = start_server()
    code, n = re.subn(r'^ADDR = "[^"]*"', f'ADDR = "{srv.addr}"', readme_example(), count=1, flags=re.M)
    assert n == 1, 'the README example must set ADDR = "..." at the start of a line'
    home, env = new_shell(tmp_path)
    (home / "readme_example.py").write_text(code, encoding="utf-8")
    proc = shell("python readme_example.py", home, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"example exited {proc.returncode}:\n{err}\nserver:\n{srv.logs()}"
    lines = out.splitlines()
    assert lines and lines[0].startswith("200 "), out
    assert all(line.startswith("200 ") for line in lines), out


@pytest.mark.slow  # ~45 s on 2 cores: eleven servers, four of them tp=2
def test_readme_commands_run_as_written_in_a_new_shell(tmp_path):
    home, env = new_shell(tmp_path)
    cmds = readme_commands()
    assert any(c.startswith("torchrun") or "torchrun" in c for c in cmds) and "mmsched sweep --dry-run" in cmds
    servers, tag = [], uuid.uuid4().hex[:8]
    try:
        for i, cmd in enumerate(cmds):
            if cmd == "make test" or cmd.startswith("source "):
                continue  # this suite itself; the set-up every command here runs after
            if cmd.startswith("make image") and container_engine():
                continue  # minutes each: tests/image builds and serves the image (make image-test)
            sock = f"ipc:///tmp/mmsched-test-readme-{tag}-{i}.sock"
            cmd_env = dict(env, MMSCHED_FRONTEND=sock)
            cmd = cmd.replace("ipc:///tmp/mmsched.sock", sock).replace("--admin 9100", f"--admin {free_port()}")
            cmd = cmd.replace("torchrun ", f"torchrun --master-port {free_port()} ", 1)
            m = re.search(r"tcp://0\.0\.0\.0:\d+", cmd)
            if m:
                sock = f"tcp://127.0.0.1:{free_port()}"
                cmd = cmd.replace(m.group(0), sock)
            if not re.search(r"\bserve\b", cmd):  # a command that finishes
                out = subprocess.run(["bash", "-c", f"{set_up()} && {cmd}"], cwd=home,
                                     env=cmd_env, capture_output=True, text=True, timeout=90)
                if cmd.startswith("make image"):  # no docker or podman here: it must say what it needs
                    assert out.returncode != 0 and "needs docker" in out.stderr, (cmd, out.stderr[-2000:])
                    continue
                assert out.returncode == 0, (cmd, out.stdout[-1000:], out.stderr[-2000:])
                if cmd == "mmsched config --print":  # "a file written by the command above"
                    (home / "mmsched.toml").write_text(out.stdout)
                if cmd.startswith("mmsched keygen --out client-keys"):  # "copy alice.key to keys/clients/"
                    (home / "keys" / "clients").mkdir(parents=True, exist_ok=True)
                    shutil.copy(home / "client-keys" / "alice.key", home / "keys" / "clients")
                continue
            log = open(tmp_path / f"server-{i}.log", "w")
            servers.append((cmd, sock, shell(cmd, home, cmd_env, stdout=log, stderr=subprocess.STDOUT), log))
        assert len(servers) >= 8, [c for c, *_ in servers]
        deadline = time.monotonic() + 120
        for cmd, sock, proc, log in servers:
            keys = {}
            if sock.startswith("tcp://"):
                keys = {"server_key": str(home / "keys" / "server.key"),
                        "client_cert": str(home / "client-keys" / "alice.key_secret")}
            while (pong := sync_ping(sock, 1.0, **keys)) is None:
                assert proc.poll() is None and time.monotonic() < deadline, (cmd, proc.poll(), _log(log))
            assert pong["type"] == "pong" and pong["healthy"], (cmd, pong)
        for cmd, sock, proc, log in servers:
            os.kill(leader_pid(proc.pid), signal.SIGTERM)
        for cmd, sock, proc, log in servers:
            assert proc.wait(timeout=90) == 0, (cmd, proc.returncode, _log(log))
            assert "Traceback" not in _log(log), (cmd, _log(log))
    finally:
        for _, sock, proc, log in servers:
            if proc.poll() is None:  # torchrun's ranks live in their own process group
                for pid in reversed(_descendants(proc.pid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
            log.close()
            path = sock[len("ipc://"):]
            if sock.startswith("ipc://") and os.path.exists(path):
                os.unlink(path)


def _log(fh) -> str:
    fh.flush()
    return Path(fh.name).read_text(errors="replace")[-3000:]
