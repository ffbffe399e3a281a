"""The tokenizer worker and the HF engine end to end: real HTTP on 127.0.0.1, a real PNG,
real tp=1 and tp=2 groups running mmsched.engines.hf (issue 14).

One tp=1 and one tp=2 group (module scope), each behind its own ``mmsched worker``
process (tp=1's takes one request at a time). Drills: ``fail-*`` fails at rank 1's engine
(tp=2), ``hold-*`` holds rank 0 in materialize for 4 s (both), long enough for a caller to
hang up or for a second request to find the worker full.
"""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

from tests.conftest import free_port, Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENGINE = "mmsched.engines.hf:HFEngine"


def png(color=(200, 30, 30), size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def chat(image: bytes, text="What is in the picture?", max_tokens=8) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"max_tokens": max_tokens, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]}


def post(port: int, body: dict | bytes, rid: str | None = None, timeout=120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data,
                                 {"Content-Type": "application/json", **({"X-Request-Id": rid} if rid else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def results(admin: int) -> dict[str, float]:
    """mmsched_results_total by status, from the leader's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'^mmsched_results_total\{status="(\d+)"\} (\S+)', text, re.M)}


class Worker:
    """A real ``mmsched worker`` process in front of ``srv``."""

    def __init__(self, srv: Server, log_dir: Path, *flags: str):
        self.port = free_port()
        self.log = open(log_dir / f"worker-{self.port}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "mmsched", "worker", "--frontend", srv.addr,
                                      "--listen", f"127.0.0.1:{self.port}", "--pool-mb", "4", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_ready(self, timeout=180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=3).status == 200:
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(Path(self.log.name).read_text())

    def log_size(self) -> int:
        return Path(self.log.name).stat().st_size

    def log_since(self, offset: int) -> str:
        """What the worker logged after ``log_size()`` returned ``offset``."""
        with open(self.log.name, "rb") as f:
            f.seek(offset)
            return f.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """{tp: (server, worker, admin port)}: both groups and workers start at once (model loads overlap)."""
    tmp = tmp_path_factory.mktemp("hf")
    admins = {1: free_port(), 2: free_port()}
    servers = {1: Server("--engine", ENGINE, "--admin", str(admins[1]), "--stall-s", "4", "--fault", "0:hold:hold-*",
                         tmp_dir=str(tmp), ready_timeout=240),
               2: Server("--engine", ENGINE, "--tp", "2", "--admin", str(admins[2]), "--stall-s", "4",
                         "--fault", "1:engine:fail-*", "--fault", "0:hold:hold-*", tmp_dir=str(tmp), ready_timeout=240)}
    workers = {1: Worker(servers[1], tmp, "--max-concurrency", "1", "--max-connections", "8", "--header-timeout", "3"),
               2: Worker(servers[2], tmp)}
    try:
        for tp in (1, 2):
            servers[tp].__enter__()
            workers[tp].wait_ready()
        yield {tp: (servers[tp], workers[tp], admins[tp]) for tp in (1, 2)}
    finally:
        for proc in [w.proc for w in workers.values()] + [s.proc for s in servers.values()]:
            proc.terminate()  # all at once: the drains overlap
        for w in workers.values():
            w.stop()
        for srv in servers.values():
            srv.__exit__(None, None, None)
    codes = {tp: srv.proc.returncode for tp, srv in servers.items()}
    assert codes == {1: 0, 2: 0}, f"a group did not drain and exit 0 after serving: {codes}"


def test_a_png_gets_text_and_tp1_and_tp2_agree(stack):
    answers = {}
    for tp in (1, 2):
        status, body = post(stack[tp][1].port, chat(png()))
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        answers[tp] = body["choices"][0]["message"]["content"]
    assert answers[1] == answers[2] and answers[1]
    status, other = post(stack[1][1].port, chat(png((10, 10, 240), (64, 64)), text="And this one?"))
    assert status == 200 and other["choices"][0]["message"]["content"] != answers[1]


@pytest.mark.parametrize("image", [b"not an image at all", png()[:60]], ids=["garbage", "truncated"])
def test_a_bad_image_is_a_400_before_mmsched_sees_it(stack, image):
    _, worker, admin = stack[2]
    before = results(admin)
    status, body = post(worker.port, chat(image))
    assert status == 400 and "image" in body["error"]["message"], body
    assert results(admin) == before


def test_a_full_worker_is_a_503_and_the_held_request_still_answers(stack):
    port = stack[1][1].port
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(post, port, chat(png()), "hold-full")
        time.sleep(1.5)  # the held request is inside mmsched
        status, body = post(port, chat(png()))
        assert status == 503 and "busy" in body["error"]["message"], body
        assert held.result()[0] == 200


def test_a_body_over_the_limit_is_a_413(stack):
    req = urllib.request.Request(f"http://127.0.0.1:{stack[1][1].port}/v1/chat/completions", b"x" * (17 << 20),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    with err.value:
        assert err.value.code == 413
        assert "body larger than" in json.loads(err.value.read())["error"]["message"]


def test_an_engine_fault_on_rank_1_is_a_500_naming_rank_1(stack):
    status, body = post(stack[2][1].port, chat(png()), rid="fail-1")
    assert status == 500, body
    assert body["error"]["failed_ranks"] == [1] and "rank 1: InjectedFault" in body["error"]["message"]


def test_a_caller_who_hangs_up_is_a_499_inside_mmsched(stack):
    _, worker, admin = stack[2]
    before = results(admin).get("499", 0)
    data = json.dumps(chat(png())).encode()
    with socket.create_connection(("127.0.0.1", worker.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: hold-1\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        time.sleep(1.0)  # inside mmsched now: rank 0 holds it in materialize for 4 s
    deadline = time.monotonic() + 30
    while results(admin).get("499", 0) == before:
        assert time.monotonic() < deadline, results(admin)
        time.sleep(0.2)
    status, _ = post(worker.port, chat(png()))  # the worker keeps serving
    assert status == 200


def test_the_readme_curl_example_runs_as_written(stack, tmp_path):
    """The README's ```bash block that calls curl, run in bash with the venv first on PATH;
    only the worker's address is changed."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M) if "curl " in b)
    script = block.replace("127.0.0.1:8000", f"127.0.0.1:{stack[2][1].port}")
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1, answer


def many_images(n: int, size=(40, 30)) -> dict:
    body = chat(png(size=size))
    body["messages"][0]["content"] *= n  # n text parts and n images
    return body


REFUSED = {  # issue 14's attacks that must be a cheap JSON 400 at the worker, naming the limit
    "14-MiB-text": ({"messages": [{"role": "user", "content": "a" * (14 << 20)}]}, "characters is over the limit"),
    "over-the-context": ({"messages": [{"role": "user", "content": " ".join(map(str, range(1500)))}]},
                         "over the model's context of 2048 tokens"),
    "decompression-bomb": (None, "too large to decode"),
    "nested-json": (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    "stream": ({**chat(png()), "stream": True}, "streaming is not supported"),
    "20-images": (None, "20 images; at most 16 per request"),
    "pixels-in-all": (None, "pixels in all are over the limit of 8000000"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_attack_is_a_quick_json_400_naming_its_limit(stack, case):
    from tests.unit.test_worker_prep import png_header

    _, worker, admin = stack[2]
    body, words = REFUSED[case]
    body = {"decompression-bomb": lambda: chat(png_header(20000, 20000)), "20-images": lambda: many_images(20),
            "pixels-in-all": lambda: many_images(3, (2000, 2000))}.get(case, lambda: body)()
    before, t0 = results(admin), time.monotonic()
    status, answer = post(worker.port, body)
    assert status == 400 and words in answer["error"]["message"], answer
    assert time.monotonic() - t0 < 15, "refused, but only after the expensive work"
    assert results(admin) == before


def test_user_text_that_looks_like_special_tokens_is_plain_text(stack):
    status, body = post(stack[2][1].port, chat(png(), text="<image> <s> </s> what now?"))
    assert status == 200, body


def test_slow_headers_are_cut_off_and_cannot_keep_callers_out(stack):
    """Half-sent headers on every place (--max-connections 8) keep no caller out: the one
    waiting longest is closed to make room (an outside attack renewed such connections before
    the deadline and held the admin endpoint, which uses the same guard, at 503); the rest are
    cut at the header deadline. A bound full of requests being served still refuses one more
    (tests/unit/test_guard.py)."""
    port = stack[1][1].port  # --max-connections 8 --header-timeout 3
    loris = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        for s in loris:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        time.sleep(0.5)  # all eight accepted: the bound is full
        status, body = post(port, chat(png()))
        assert status == 200, body
        loris[0].settimeout(5)
        assert loris[0].recv(4096) == b""  # the oldest made room
        for s in loris[1:]:  # cut at the header deadline: the server closes them
            s.settimeout(15)
            assert s.recv(4096) == b""
    finally:
        for s in loris:
            s.close()


def test_callers_that_hang_up_mid_body_are_one_quiet_log_line_each(stack):
    """A caller gone before its body arrived is not the worker's error: no ERROR, no traceback
    (outside testing: 20 such callers wrote 20 tracebacks to the worker's log), still served."""
    worker = stack[2][1]
    body = json.dumps(chat(png())).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    logged = worker.log_size()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", worker.port)) as s:
            s.sendall(head + body[: len(body) // 2])  # and hang up
    status, answer = post(worker.port, chat(png()))
    assert status == 200, answer
    new = worker.log_since(logged)
    assert "Traceback" not in new and " E [worker]" not in new, new
    assert new.count("caller_gone") == 5, new


def test_bodies_and_messages_aiohttp_cannot_decode_are_400s_without_tracebacks(stack):
    """Outside testing: a gzip body that is not gzip was a 500 "internal error", and malformed
    HTTP (a chunk size that is not hex) an ERROR with a traceback in the worker's log."""
    worker = stack[2][1]
    logged = worker.log_size()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"

    def send(raw: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", worker.port)) as s:
            s.settimeout(30)
            s.sendall(raw)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    for coding in (b"gzip", b"deflate"):
        reply = send(head + b"Content-Encoding: %s\r\nContent-Length: 10\r\n\r\n0123456789" % coding)
        status, _, rest = reply.partition(b"\r\n\r\n")[0].partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 400"), reply
        assert b"application/json" in rest and b"body could not be read" in reply, reply
    reply = send(head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
    assert reply.split(b" ", 2)[1] == b"400", reply  # aiohttp's own answer to broken HTTP
    status, answer = post(worker.port, chat(png()))
    assert status == 200, answer
    new = worker.log_since(logged)
    assert "Traceback" not in new and " E [worker]" not in new and "Error handling" not in new, new
    assert new.count("bad_http_request") >= 1, new  # the broken chunk's (aiohttp may log each bad body too)


def test_with_mmsched_down_a_chat_is_a_503_at_once(tmp_path):
    """A worker whose mmsched never answers: after its pings miss, chats are 503 without waiting --timeout."""
    worker = Worker(SimpleNamespace(addr=f"ipc://{tmp_path}/nobody.sock"), tmp_path, "--timeout", "60")
    try:
        deadline, status = time.monotonic() + 120, None
        while status != 503:
            assert time.monotonic() < deadline and worker.proc.poll() is None, Path(worker.log.name).read_text()
            try:
                status, body = post(worker.port, chat(png()), timeout=5)
            except OSError:  # not listening yet, or still waiting for mmsched
                time.sleep(0.5)
        t0 = time.monotonic()
        status, body = post(worker.port, chat(png()), timeout=30)
        assert status == 503 and "mmsched does not answer" in body["error"]["message"], body
        assert time.monotonic() - t0 < 5
    finally:
        worker.stop()
