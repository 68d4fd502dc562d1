"""The remote reward client and the reward server, for real over 127.0.0.1 (ephemeral ports, bounded waits)."""

from __future__ import annotations

import base64
import json
import runpy
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from flowgrpo.rewards import get_reward, list_rewards
from flowgrpo.rewards.remote import (
    RemoteReward,
    RemoteRewardAuthError,
    RemoteRewardConnectionError,
    RemoteRewardHTTPError,
    RemoteRewardProtocolError,
    RemoteRewardTimeoutError,
    decode_image,
    encode_image,
)
from flowgrpo.rewards.server import build_arg_parser, serve, server_from_args

TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _images(n: int, size: int = 32) -> list[Image.Image]:
    """Images of increasing noise (so JPEG sizes, hence scores, differ)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        base = np.full((size, size, 3), 40 * i % 255, dtype=np.float32)
        noise = rng.normal(0, 12 * i, size=(size, size, 3))
        out.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB"))
    return out


@pytest.fixture
def jpeg_server():
    server = serve(["jpeg_compressibility"], port=0, token="")
    yield server
    server.shutdown()


class _RawServer:
    """A tiny hand-written HTTP server whose POST behaviour a test chooses (for failure modes)."""

    def __init__(self, post, health=None):
        calls = self.calls = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body: bytes, ctype="application/json"):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up first (the timeout tests)
                    pass

            def do_GET(self):
                if health is not None:
                    health(self)
                else:
                    self._send(200, json.dumps({"status": "ok", "rewards": ["x"], "default": "x"}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body)
                post(self, body, len(calls), outer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def raw_server():
    servers = []

    def make(post, health=None):
        servers.append(_RawServer(post, health))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------------
# Scores over the wire equal the in-process reward
# ------------------------------------------------------------------------------------------------------


def test_remote_scores_equal_in_process(jpeg_server):
    prompts = [f"prompt {i}" for i in range(5)]
    images = _images(5)
    expected = get_reward("jpeg_compressibility")(prompts, images)
    assert len(set(expected)) > 1

    client = get_reward("remote", url=jpeg_server.url, reward_name="jpeg_compressibility", timeout=10)
    assert isinstance(client, RemoteReward)
    assert client.server_rewards == ["jpeg_compressibility"]
    assert client(prompts, images) == expected
    # Server default reward, and several requests of batch_size images each.
    chunked = RemoteReward(jpeg_server.url, batch_size=2, timeout=10)
    assert chunked(prompts, images) == expected
    assert client([], []) == []


def test_columns_reach_the_reward_and_null_scores_become_none():
    seen = {}

    def by_column(prompts, images, **columns):
        seen.update(columns)
        return [None if v < 0 else (float("nan") if v == 99 else v * images[i].size[0]) for i, v in enumerate(columns["value"])]

    server = serve({"by_column": by_column}, port=0, token="")
    try:
        client = RemoteReward(server.url, reward_name="by_column", timeout=10)
        images = _images(4, size=8)
        scores = client(["a", "b", "c", "d"], images, value=np.array([0.5, -1.0, 2.0, 99.0]), category=["x"] * 4)
    finally:
        server.shutdown()
    assert scores == [4.0, None, 16.0, None]
    assert seen == {"value": [0.5, -1.0, 2.0, 99.0], "category": ["x"] * 4}


def test_image_round_trip_png_is_lossless_and_jpeg_is_close():
    img = _images(3)[2]
    assert np.array_equal(np.asarray(decode_image(encode_image(img, "png"))), np.asarray(img))
    jpeg = decode_image(encode_image(img, "jpeg", jpeg_quality=95))
    assert jpeg.size == img.size and jpeg.format == "JPEG"
    with pytest.raises(ValueError, match="image_format"):
        encode_image(img, "gif")
    with pytest.raises(ValueError, match="decode"):
        decode_image(base64.b64encode(b"GIF89a not an allowed format").decode())


def test_ocr_served_remotely_matches_in_process():
    pytest.importorskip("rapidocr")
    if "ocr" not in list_rewards():
        pytest.skip("ocr reward not registered")
    ocr = get_reward("ocr")
    server = serve({"ocr": ocr}, port=0, token="")
    try:
        img = Image.new("RGB", (192, 64), "white")
        ImageDraw.Draw(img).text((10, 20), "HELLO 42", fill="black", font_size=28)
        prompts = ['a sign that says "HELLO 42"']
        expected = ocr(prompts, [img])
        assert expected[0] > 0.5  # the text is legible: a meaningful score, not a trivial 0
        assert RemoteReward(server.url, reward_name="ocr", timeout=30)(prompts, [img]) == expected
    finally:
        server.shutdown()


# ------------------------------------------------------------------------------------------------------
# Failure modes: down, slow, garbage, wrong token, flaky
# ------------------------------------------------------------------------------------------------------


def test_server_down_is_a_clear_error_at_start_up():
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteRewardConnectionError) as info:
        RemoteReward(url, max_retries=1, backoff=0.01, timeout=2)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert url in message and "unreachable" in message and "flowgrpo-reward-server" in message


def test_slow_server_times_out_within_the_deadline(raw_server):
    def slow(handler, body, n, server):
        server.release.wait(5)  # longer than the client's timeout; released at teardown

    srv = raw_server(slow)
    client = RemoteReward(srv.url, timeout=0.5, max_retries=1, backoff=0.05)
    start = time.monotonic()
    with pytest.raises(RemoteRewardTimeoutError, match="timed out after 0.5 s.*2 attempts"):
        client(["p"], _images(1, 8))
    assert time.monotonic() - start < 2.5
    assert len(srv.calls) == 2

    lenient = RemoteReward(srv.url, timeout=0.5, max_retries=0, on_failure="none")
    start = time.monotonic()
    assert lenient(["p", "q"], _images(2, 8)) == [None, None]
    assert time.monotonic() - start < 1.5


def test_trickling_server_cannot_outlast_the_deadline(raw_server):
    def trickle(handler, body, n, server):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(40):  # one byte every 0.1 s: no single read times out, the whole exchange must
            if server.release.wait(0.1):
                return
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return

    srv = raw_server(trickle)
    client = RemoteReward(srv.url, timeout=0.5, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RemoteRewardTimeoutError):
        client(["p"], _images(1, 8))
    assert time.monotonic() - start < 1.5


@pytest.mark.parametrize(
    "body, match",
    [
        (b"<html>Internal proxy page</html>", "valid JSON"),
        (b'{"result": [1.0]}', "no 'scores'"),
        (b'{"scores": [1.0, 2.0]}', "2 scores for 1 images"),
        (b'{"scores": ["high"]}', "finite number or null"),
        (b'{"scores": [NaN]}', "valid JSON"),
        (b'{"scores": [true]}', "finite number or null"),
    ],
)
def test_garbage_answers_are_clear_errors(raw_server, body, match):
    def garbage(handler, request, n, server):
        handler._send(200, body)

    srv = raw_server(garbage)
    with pytest.raises(RemoteRewardProtocolError, match=match):
        RemoteReward(srv.url, timeout=2, max_retries=2, backoff=0.01)(["p"], _images(1, 8))
    assert len(srv.calls) == 1  # a malformed body is not retried


def test_health_check_rejects_a_server_that_is_not_a_reward_server(raw_server):
    def not_ours(handler):
        handler._send(200, b'{"hello": "world"}')

    srv = raw_server(lambda *a: None, health=not_ours)
    with pytest.raises(RemoteRewardProtocolError, match="flowgrpo reward server"):
        RemoteReward(srv.url, timeout=2)


def test_unknown_reward_name_is_reported_at_start_up(jpeg_server):
    with pytest.raises(ValueError, match=r"does not serve reward 'ocr'.*jpeg_compressibility"):
        RemoteReward(jpeg_server.url, reward_name="ocr", timeout=5)


def test_wrong_or_missing_token_is_refused(monkeypatch):
    server = serve(["jpeg_compressibility"], port=0, token="s3cret")
    try:
        images = _images(2, 8)
        with pytest.raises(RemoteRewardAuthError, match=rf"401.*\${TOKEN_ENV}, which is not set"):
            RemoteReward(server.url, timeout=5)
        monkeypatch.setenv(TOKEN_ENV, "wrong")
        with pytest.raises(RemoteRewardAuthError, match="401"):
            RemoteReward(server.url, timeout=5)
        client = RemoteReward(server.url, timeout=5, health_check=False)
        with pytest.raises(RemoteRewardAuthError, match="missing or wrong"):
            client(["a", "b"], images)
        # A plain request without the header is refused too, with a JSON error.
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{server.url}/health", timeout=5)
        assert info.value.code == 401 and "error" in json.loads(info.value.read())

        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert RemoteReward(server.url, timeout=5)(["a", "b"], images) == get_reward("jpeg_compressibility")(
            ["a", "b"], images
        )
    finally:
        server.shutdown()


def test_retries_with_backoff_recover_from_a_flaky_server(raw_server):
    def flaky(handler, body, n, server):
        if n == 1:  # drop the connection without an answer
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
        elif n == 2:
            handler._send(503, b'{"error": "warming up"}')
        else:
            handler._send(200, json.dumps({"scores": [0.25] * len(body["prompts"]), "reward": "x"}).encode())

    srv = raw_server(flaky)
    client = RemoteReward(srv.url, timeout=2, max_retries=2, backoff=0.01)
    assert client(["a", "b"], _images(2, 8)) == [0.25, 0.25]
    assert len(srv.calls) == 3
    assert srv.calls[-1]["image_format"] == "png" and srv.calls[-1]["reward"] is None

    # Out of retries: the last failure is reported, with the attempt count.
    srv.calls.clear()
    with pytest.raises(RemoteRewardHTTPError, match="HTTP 503: warming up .gave up after 2 attempts"):
        RemoteReward(srv.url, timeout=2, max_retries=1, backoff=0.01, health_check=False)(["a"], _images(1, 8))


def test_persistent_5xx_and_client_errors(raw_server):
    def broken(handler, body, n, server):
        status = 500 if body["prompts"][0] == "five" else 422
        handler._send(status, json.dumps({"error": f"status {status}"}).encode())

    srv = raw_server(broken)
    client = RemoteReward(srv.url, timeout=2, max_retries=1, backoff=0.01)
    with pytest.raises(RemoteRewardHTTPError, match="HTTP 500: status 500") as info:
        client(["five"], _images(1, 8))
    assert info.value.status == 500 and len(srv.calls) == 2
    srv.calls.clear()
    with pytest.raises(RemoteRewardHTTPError, match="HTTP 422"):  # 4xx: not retried
        client(["four"], _images(1, 8))
    assert len(srv.calls) == 1
    lenient = RemoteReward(srv.url, timeout=2, max_retries=0, on_failure="none")
    assert lenient(["five"], _images(1, 8)) == [None]
    with pytest.raises(RemoteRewardHTTPError, match="422"):  # configuration errors are never hidden
        lenient(["four"], _images(1, 8))


# ------------------------------------------------------------------------------------------------------
# Server-side validation and the command line
# ------------------------------------------------------------------------------------------------------


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/score", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_rejects_bad_requests():
    def raises(prompts, images, **columns):
        raise RuntimeError("scorer exploded")

    def short(prompts, images, **columns):
        return [1.0]

    server = serve({"raises": raises, "short": short}, port=0, token="", max_request_bytes=4000)
    try:
        img = encode_image(_images(1, 8)[0])
        ok = {"prompts": ["a", "b"], "images": [img, img]}
        assert _post(server.url, b"{not json")[0] == 400
        assert _post(server.url, json.dumps({"prompts": ["a"], "images": []}).encode())[0] == 400
        status, err = _post(server.url, json.dumps({**ok, "images": [img, "bm90IGFuIGltYWdl"]}).encode())
        assert status == 400 and "image 1" in err["error"]
        status, err = _post(server.url, json.dumps({**ok, "reward": "nope"}).encode())
        assert status == 404 and "raises" in err["error"]
        status, err = _post(server.url, json.dumps({**ok, "columns": {"c": [1]}}).encode())
        assert status == 400 and "column 'c'" in err["error"]
        status, err = _post(server.url, json.dumps(ok).encode())  # default reward = the first
        assert status == 500 and "scorer exploded" in err["error"]
        status, err = _post(server.url, json.dumps({**ok, "reward": "short"}).encode())
        assert status == 500 and "1 scores for 2 images" in err["error"]
        status, err = _post(server.url, json.dumps({**ok, "images": [img + " " * 4000, img]}).encode())
        assert status == 413 and "limit" in err["error"]
        # The server is still healthy after all of that.
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ok", "rewards": ["raises", "short"], "default": "raises"}
    finally:
        server.shutdown()


def test_command_line_serves_named_rewards_with_a_token(monkeypatch):
    monkeypatch.setenv("MY_REWARD_TOKEN", "t0ken")
    args = build_arg_parser().parse_args(
        ["--rewards", "jpeg_compressibility", "--port", "0", "--token-env", "MY_REWARD_TOKEN", "--max-request-mb", "1"]
    )
    server = server_from_args(args)
    try:
        assert server.token == "t0ken" and server.max_request_bytes == 2**20
        with pytest.raises(RemoteRewardAuthError):
            RemoteReward(server.url, token_env="OTHER_UNSET_VAR", timeout=5)
        client = RemoteReward(server.url, token_env="MY_REWARD_TOKEN", timeout=5)
        assert client.server_rewards == ["jpeg_compressibility"]
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="not among the served rewards"):
        serve(["jpeg_compressibility"], port=0, reward_kwargs={"ocr": {}})


def test_reward_server_script_calls_main(monkeypatch, capsys):
    script = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(script), run_name="__main__")
    assert info.value.code == 0
    assert "--rewards" in capsys.readouterr().out
