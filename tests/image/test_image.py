"""The image of docker/Dockerfile, built, then served from the way docker-compose.yml runs it.

Opt-in and slow: `make image-test` (MMSCHED_IMAGE_TEST=1, with docker or podman). The test
builds the image with `make image`, starts the service from it as the container would (the
image's entrypoint, command, user, environment and workdir; the config baked in at
/etc/mmsched, or compose's configs/tp2.toml mounted over it; /run/mmsched a directory shared
with this host; /dev/shm this host's), and drives it from this host: a ping, a shm request
whose bytes the ranks digest, the compose healthcheck's own command run inside, SIGTERM.

With `docker run`/`podman run` where they work. Where they cannot (a sandbox without
cgroups or rlimits), from the image's root filesystem (`podman image mount`): chroot as the
image's user, in private mount and network namespaces; the network one stands in for the
container's own, so the admin port binds there and not on this host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import yaml

from tests.conftest import pid_alive, sync_ping
from tests.unit.test_compose import _seconds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = os.environ.get("ENGINE", "")
IMAGE = os.environ.get("IMAGE", "mmsched:latest")
CONFIG = "/etc/mmsched/mmsched.toml"
RUN_DIR = "/run/mmsched"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # a first build downloads and installs for minutes
    pytest.mark.skipif(not (os.environ.get("MMSCHED_IMAGE_TEST") and shutil.which(ENGINE or "-")),
                       reason="`make image-test` builds and runs the image (needs docker or podman)"),
]

# A tokenizer worker on the host: one shm feature, the ranks' digest against its own. It
# becomes the image's uid once its imports are loaded (this host's Python may lie where only
# root reads): the ranks open its 0600 segments as that uid.
CLIENT = """
import asyncio, json, os, sys
from mmsched.client import Client, pooled, shm
from mmsched.producers import ShmPool
from tests.integration.lifecycle import feature, sha256_of

uid = int(sys.argv[2])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)

async def main():
    x = feature(15, shape=(64, 256))
    pool = ShmPool(1 << 20)  # a pooled feature: read through the guarded copy where it is built
    try:
        async with Client(sys.argv[1], timeout=60, shm_pool=pool) as c:
            r = await c.embed([1, 2, 3], [shm(x)], want_digest=True)
            p = await c.embed([1, 2, 3], [pooled(x)], want_digest=True)
    finally:
        pool.close()
    print(json.dumps({"status": [r.status, p.status], "message": [r.message, p.message],
                      "digests": [r.meta.get("digests"), p.meta.get("digests")], "sent": sha256_of(x)}))

asyncio.run(main())
"""


def _engine(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout, check=check)


def say(line: str) -> None:
    """The transcript (`make image-test` runs pytest -s)."""
    print(f"[image-test] {line}", flush=True)


@pytest.fixture(scope="module")
def image() -> dict:
    """`make image` (the caller's BASE_IMAGE, TORCH_WHEELS, PIP_CERT ... pass through), then
    the image's config: Entrypoint, Cmd, User, Env, WorkingDir."""
    t0 = time.monotonic()
    build = subprocess.run(["make", "--no-print-directory", "-C", REPO, "image"],
                           capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, f"make image failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    info = json.loads(_engine("image", "inspect", IMAGE).stdout)[0]
    say(f"make image: {IMAGE} built in {time.monotonic() - t0:.0f} s, {info['Size'] / 1e6:.0f} MB")
    return info["Config"]


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml's services."""
    with open(os.path.join(REPO, "docker", "docker-compose.yml")) as fh:
        return yaml.safe_load(fh)["services"]


class Container:
    """`ENGINE run` as compose runs the mmsched service: --init, /dev/shm the host's."""

    def __init__(self, image: dict, run_dir: str, config: str | None, log) -> None:
        self.name = f"mmsched-image-test-{uuid.uuid4().hex[:8]}"
        mounts = ["-v", f"{run_dir}:{RUN_DIR}"] + (["-v", f"{config}:{CONFIG}:ro"] if config else [])
        self.proc = subprocess.Popen([ENGINE, "run", "--rm", "--name", self.name, "--init", "--ipc=host",
                                      *mounts, IMAGE], stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def uid(image: dict) -> int:
        return int(_engine("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exec(self, argv: list[str]) -> subprocess.CompletedProcess:
        return _engine("exec", self.name, *argv, timeout=30, check=False)

    def stop(self, timeout: float) -> int:
        _engine("kill", "--signal", "TERM", self.name, check=False)
        return self.proc.wait(timeout)

    def close(self) -> None:
        _engine("rm", "--force", self.name, check=False)
        self.proc.wait(30)


class Chroot:
    """The image's root filesystem run the way the container would be, where `run` cannot."""

    ROOT: str = ""
    # Private mount and network namespaces: the mounts and the admin port vanish with it.
    SCRIPT = """set -e
root=$1 run=$2 config=$3; shift 3
ip link set lo up
mount --rbind /dev "$root/dev"  # /dev/shm: this host's, as ipc: shareable shares one
mount -t proc proc "$root/proc"
mount -t tmpfs tmpfs "$root/tmp"  # the image's root is mounted read-only
mount --bind "$run" "$root/run/mmsched"
[ -z "$config" ] || mount --bind -o ro "$config" "$root/etc/mmsched/mmsched.toml"
exec chroot "$@"
"""

    def __init__(self, image: dict, run_dir: str, config: str | None, log) -> None:
        self.user = self.uid(image)
        argv = ["/usr/bin/env", "-i", "-C", image["WorkingDir"], *image["Env"],
                *image["Entrypoint"], *(image["Cmd"] or [])]
        self.env = image["Env"]
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--net", "sh", "-c", self.SCRIPT, "sh", self.ROOT, run_dir, config or "",
             f"--userspec={self.user}:{self.user}", self.ROOT, *argv],
            stdout=log, stderr=subprocess.STDOUT)

    @classmethod
    def uid(cls, image: dict) -> int:
        """The image's USER, looked up in the image's own /etc/passwd."""
        with open(os.path.join(cls.ROOT, "etc", "passwd")) as fh:
            for line in fh:
                name, _, uid, *_ = line.split(":")
                if image["User"] in (name, uid):
                    return int(uid)
        raise AssertionError(f"USER {image['User']!r} is not in the image's /etc/passwd")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exec(self, argv: list[str]) -> subprocess.CompletedProcess:
        """Inside: the server's namespaces and root, its user, the image's environment."""
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "-n", "-r", "-w",
                               "-S", str(self.user), "-G", str(self.user), "/usr/bin/env", "-i",
                               *self.env, *argv], capture_output=True, text=True, timeout=30)

    def stop(self, timeout: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def box(image):
    """Container where `ENGINE run` works, else Chroot on `podman image mount`."""
    tried = _engine("run", "--rm", "--entrypoint", "true", IMAGE, check=False)
    if tried.returncode == 0:
        say(f"{ENGINE} run works: the service runs in a container")
        yield Container
        return
    assert ENGINE == "podman", f"{ENGINE} run failed: {tried.stderr}"
    say(f"{ENGINE} run fails here ({tried.stderr.strip().splitlines()[-1]}): "
        "chroot into `podman image mount`, private mount and network namespaces")
    Chroot.ROOT = _engine("image", "mount", IMAGE).stdout.strip()
    try:
        yield Chroot
    finally:
        _engine("image", "unmount", IMAGE, check=False)


@pytest.fixture
def run_dir(box, image):
    """The directory shared with the host at /run/mmsched, owned by the image's user (as
    compose's named volume is: it takes the image directory's owner)."""
    path = tempfile.mkdtemp(prefix="mmsched-image-test-")
    os.chmod(path, 0o755)
    uid = box.uid(image)
    os.chown(path, uid, uid)
    yield path, uid
    shutil.rmtree(path, ignore_errors=True)


def _wait(cond, timeout: float, what: str, srv):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert srv.alive(), f"the service exited {srv.proc.returncode} before {what}"
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.mark.parametrize("config", ["baked", "compose"])
def test_the_image_serves_a_host_client_and_drains(image, compose, box, run_dir, config, tmp_path):
    directory, uid = run_dir
    service = compose["mmsched"]
    mount = None
    if config == "compose":  # compose's own bind of configs/tp2.toml over the baked config
        bind = next(v for v in service["volumes"] if v["target"] == CONFIG)
        mount = os.path.normpath(os.path.join(REPO, "docker", bind["source"]))
    log_path = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        srv = box(image, directory, mount, log)
    say(f"[{config}] started {' '.join(image['Entrypoint'] + image['Cmd'])} as uid {uid}"
        f"{'' if mount is None else f' with {os.path.relpath(mount, REPO)} at {CONFIG}'}")
    try:
        sock = os.path.join(directory, "mmsched.sock")
        pong = _wait(lambda: sync_ping(f"ipc://{sock}", 1.0), 90, "a pong on the shared socket", srv)
        say(f"[{config}] host ping ipc://{sock}: {pong} after {time.monotonic() - t0:.1f} s")
        owner = os.stat(sock).st_uid
        assert owner == uid != 0, f"the socket is owned by uid {owner}: the server runs as root"

        env = {k: v for k, v in os.environ.items() if not k.startswith("MMSCHED_")}
        client = subprocess.run([sys.executable, "-c", CLIENT, f"ipc://{sock}", str(uid)], cwd=REPO,
                                env=env, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        got = json.loads(client.stdout)
        say(f"[{config}] host client (uid {uid}) shm and pooled requests: status {got['status']}, "
            f"ranks' digests {[[d[:12] for d in ds or []] for ds in got['digests']]}, sent {got['sent'][:12]}")
        assert got["status"] == [200, 200], got["message"]
        assert got["digests"] == [[got["sent"]]] * 2, "the ranks read other bytes than the client wrote"

        # the wheel stage's compiler: pooled segments are read with the guarded copy, not pread
        # (unless the build was told to accept an image without it)
        guarded = srv.exec(["python", "-c", "import mmsched.transport._guarded_copy as g; print(g.__file__)"])
        say(f"[{config}] guarded copy inside: {(guarded.stdout or guarded.stderr).strip().splitlines()[-1:]}")
        assert guarded.returncode == 0 or os.environ.get("ALLOW_NO_GUARDED_COPY"), \
            f"the image has no guarded copy (its wheel stage found no compiler):\n{guarded.stderr}"

        check = service["healthcheck"]["test"]
        assert check[0] == "CMD"
        health = _wait(lambda: (r := srv.exec(check[1:])).returncode == 0 and r, 30,
                       "the compose healthcheck passing inside", srv)
        say(f"[{config}] compose healthcheck inside: exit {health.returncode} (healthy)")

        # compose's load generator: its command from the image, beside the server (its IPC
        # namespace, its socket directory), cut to 40 requests in 2 s.
        worker = list(compose["loadgen"]["command"])
        for flag, value in (("--rate", "20"), ("--requests", "40"), ("--duration", "2")):
            worker[worker.index(flag) + 1] = value
        load = srv.exec([*image["Entrypoint"], *worker])
        say(f"[{config}] tokenizer-worker inside: exit {load.returncode}\n{load.stdout.strip()}")
        assert load.returncode == 0, load.stdout + load.stderr
        assert re.search(r"^\s*200\s+40\s", load.stdout, re.M), "not every worker request got a 200"

        t1 = time.monotonic()
        code = srv.stop(timeout=_seconds(service["stop_grace_period"]))
        logs = log_path.read_text(errors="replace")
        say(f"[{config}] SIGTERM: exit {code} in {time.monotonic() - t1:.1f} s; "
            f"log has draining={'draining' in logs} stopped={'stopped' in logs}")
        assert code == 0, logs[-3000:]
        assert "draining" in logs and "stopped" in logs, logs[-3000:]
        assert not os.path.exists(sock), "the stop leaves the socket file behind"
    except BaseException:
        print(log_path.read_text(errors="replace")[-5000:])
        raise
    finally:
        srv.close()
        assert not pid_alive(srv.proc.pid)
