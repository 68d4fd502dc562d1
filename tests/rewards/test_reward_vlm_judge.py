"""`vlm_judge` against a small local server speaking the OpenAI chat-completions API, and its score parser."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from flowgrpo.rewards import get_reward
from flowgrpo.rewards.remote import (
    RemoteRewardAuthError,
    RemoteRewardConnectionError,
    RemoteRewardHTTPError,
    RemoteRewardProtocolError,
)
from flowgrpo.rewards.vlm_judge import VLMJudgeReward, parse_score

MODEL = "tiny-judge-vl"
KEY_ENV = "FLOWGRPO_TEST_JUDGE_KEY"


class ChatServer:
    """A fake chat-completions endpoint: answers with ``reply(user_text)`` after ``delay`` seconds."""

    def __init__(self, reply, delay: float = 0.0, status: int = 200, models=(MODEL,)):
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up first (the timeout tests)
                    pass

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.requests.append(body)
                    outer.headers.append(dict(self.headers))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:  # the reply is made while in flight, then sent once this request no longer counts: a
                    # client that reads it and sends its next request must not find this one still counted
                    time.sleep(delay)
                    text = "".join(p["text"] for p in body["messages"][-1]["content"] if p["type"] == "text")
                    if status != 200:
                        code, payload = status, {"error": {"message": f"status {status}"}}
                    elif isinstance(answer := reply(text), dict):  # a raw (possibly malformed) body
                        code, payload = 200, answer
                    else:
                        code, payload = 200, {
                            "id": "chatcmpl-1",
                            "object": "chat.completion",
                            "model": body["model"],
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                         "finish_reason": "stop"}],
                        }
                finally:
                    with lock:
                        outer.in_flight -= 1
                self._send(code, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def chat_server():
    servers = []

    def make(*args, **kwargs):
        servers.append(ChatServer(*args, **kwargs))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.fixture(autouse=True)
def _no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


def _image(color, size=(24, 16)) -> Image.Image:
    return Image.new("RGB", size, color)


ANSWERS = {"a red square": "Score: 7/10", "a blue circle": "I would say 85%", "a cat": "Hard to tell, sorry."}


def _reply_from_prompt(text: str) -> str:
    return next(answer for prompt, answer in ANSWERS.items() if f'"{prompt}"' in text)


def test_request_shape_and_scores(chat_server, monkeypatch):
    srv = chat_server(_reply_from_prompt)
    monkeypatch.setenv(KEY_ENV, "sk-local")
    judge = get_reward("vlm_judge", base_url=srv.base_url, model=MODEL, api_key_env=KEY_ENV,
                       system_prompt="You are a strict judge.", timeout=5)
    assert isinstance(judge, VLMJudgeReward)
    prompts = list(ANSWERS)
    images = [_image("red"), _image("blue"), _image("gray", size=(10, 30))]
    assert judge(prompts, images) == [0.7, 0.85, None]

    assert len(srv.requests) == 3
    by_prompt = {}
    for body, headers in zip(srv.requests, srv.headers):
        assert body["model"] == MODEL and body["temperature"] == 0.0 and body["max_tokens"] > 0
        assert headers["Authorization"] == "Bearer sk-local"
        system, user = body["messages"]
        assert system == {"role": "system", "content": "You are a strict judge."}
        assert user["role"] == "user"
        kinds = [part["type"] for part in user["content"]]
        assert kinds == ["image_url", "text"]
        url = user["content"][0]["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        decoded = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        text = user["content"][1]["text"]
        prompt = next(p for p in prompts if f'"{p}"' in text)
        by_prompt[prompt] = decoded
    for prompt, image in zip(prompts, images):
        assert by_prompt[prompt].size == image.size
        assert by_prompt[prompt].convert("RGB").getpixel((0, 0)) == image.getpixel((0, 0))


def test_template_columns_scale_and_custom_parser(chat_server):
    srv = chat_server(lambda text: "Rating: 8" if "[animals]" in text else "Rating: 3")
    judge = VLMJudgeReward(model=MODEL, base_url=srv.base_url + "/chat/completions",
                           prompt_template="Category [{category}]. Grade this image for: {prompt}", scale=10,
                           image_format="jpeg", timeout=5)
    scores = judge(["a dog", "a car"], [_image("white"), _image("black")], category=["animals", "vehicles"])
    assert scores == [0.8, 0.3]
    assert all(r["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
               for r in srv.requests)
    judge_custom = VLMJudgeReward(model=MODEL, base_url=srv.base_url, score_parser=lambda t: 1.0 if "8" in t else 0.0,
                                  prompt_template="[{category}] {prompt}", timeout=5)
    assert judge_custom(["x", "y"], [_image("white")] * 2, category=["animals", "cars"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="'missing'"):
        VLMJudgeReward(model=MODEL, base_url=srv.base_url, prompt_template="{prompt} {missing}", timeout=5)(
            ["x"], [_image("white")]
        )


def test_concurrency_is_bounded(chat_server):
    srv = chat_server(lambda text: "Score: 5/10", delay=0.15)
    judge = VLMJudgeReward(model=MODEL, base_url=srv.base_url, max_concurrency=2, timeout=5)
    start = time.monotonic()
    assert judge([f"p{i}" for i in range(6)], [_image("red")] * 6) == [0.5] * 6
    elapsed = time.monotonic() - start
    assert srv.max_in_flight == 2  # parallel, but never more than max_concurrency
    assert elapsed >= 3 * 0.15 - 0.02


def test_failures(chat_server, monkeypatch):
    # Unreachable server: clear error at construction.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteRewardConnectionError, match=f"127.0.0.1:{port}.*unreachable.*vllm serve"):
        VLMJudgeReward(model=MODEL, base_url=f"http://127.0.0.1:{port}/v1", timeout=2, backoff=0.01)

    ok = chat_server(lambda text: "Score: 1/10")
    with pytest.raises(ValueError, match="not served.*tiny-judge-vl"):
        VLMJudgeReward(model="other-model", base_url=ok.base_url, timeout=2)

    # Persistent 5xx: None per image after the retries (default), or an error with on_failure="raise".
    broken = chat_server(lambda text: "", status=503)
    judge = VLMJudgeReward(model=MODEL, base_url=broken.base_url, max_retries=1, backoff=0.01, timeout=2)
    assert judge(["a", "b"], [_image("red")] * 2) == [None, None]
    assert len(broken.requests) == 4
    with pytest.raises(RemoteRewardHTTPError, match="503"):
        VLMJudgeReward(model=MODEL, base_url=broken.base_url, max_retries=0, timeout=2, on_failure="raise")(
            ["a"], [_image("red")]
        )

    # A refused key is a configuration error: it raises.
    refused = chat_server(lambda text: "", status=401)
    monkeypatch.setenv(KEY_ENV, "bad")
    with pytest.raises(RemoteRewardAuthError, match=f"{KEY_ENV}, which is set"):
        VLMJudgeReward(model=MODEL, base_url=refused.base_url, api_key_env=KEY_ENV, timeout=2)(["a"], [_image("red")])

    # A slow judge: the deadline holds, the image scores None.
    slow = chat_server(lambda text: "Score: 9/10", delay=1.5)
    start = time.monotonic()
    judge = VLMJudgeReward(model=MODEL, base_url=slow.base_url, timeout=0.4, max_retries=0)
    assert judge(["a"], [_image("red")]) == [None]
    assert time.monotonic() - start < 1.3


def test_malformed_completion_is_an_error(chat_server):
    srv = chat_server(lambda text: {"object": "chat.completion", "choices": []})
    judge = VLMJudgeReward(model=MODEL, base_url=srv.base_url, timeout=2)
    with pytest.raises(RemoteRewardProtocolError, match="choices"):
        judge(["a"], [_image("red")])


@pytest.mark.parametrize(
    "text, scale, expected",
    [
        ("7/10", None, 0.7),
        ("Score: 7/10", None, 0.7),
        ("score: 7.5 / 10.", None, 0.75),
        ("I'd rate it 8 out of 10", None, 0.8),
        ("85%", None, 0.85),
        ("Score: 0.8", None, 0.8),
        ("0.35", None, 0.35),
        ("1", None, 1.0),
        ("Score: 7", None, None),  # a bare number outside [0, 1] needs a scale
        ("Score: 7", 10, 0.7),
        ("Rating: 85", 100, 0.85),
        ("There are 3 cats and 2 dogs. Score: 6/10", None, 0.6),
        ("Score: 9/10. Two of the 3 objects are right.", None, 0.9),
        ("The layout is 2/3 correct.\nFinal verdict: 4/5", None, 0.8),
        ("<think>maybe 2/10... no</think> Score: 9/10", None, 0.9),
        ("12/10", None, None),
        ("Score: -1/10", None, None),
        ("3/0", None, None),
        ("no idea", None, None),
        ("", None, None),
        (None, None, None),
    ],
)
def test_parse_score(text, scale, expected):
    value = parse_score(text, scale=scale)
    if expected is None:
        assert value is None
    else:
        assert value == pytest.approx(expected)
