"""A reward server: serves any registered reward(s) over the JSON/HTTP protocol of the `remote` reward.

Run it on the machine that should do the scoring (an OCR engine, a detector, a big scorer on its own GPU)::

    FLOWGRPO_REWARD_TOKEN=s3cret flowgrpo-reward-server --rewards ocr jpeg_compressibility --host 0.0.0.0 --port 8000

and point the trainer at it with ``reward_funcs=["remote"]`` and
``reward_kwargs={"remote": {"url": "http://that-machine:8000", "reward_name": "ocr"}}``.

Endpoints (see `flowgrpo.rewards.remote` for the full protocol):

* ``GET /health`` -> ``{"status": "ok", "rewards": [...], "default": name}``
* ``POST /score`` with ``{"prompts", "images" (base64 PNG/JPEG; a video is a list of them, its frames),
  "image_format", "columns", "reward"}`` (and ``"image_columns"``: columns of base64 images, e.g. the source images
  of editing rewards, decoded to PIL images)
  -> ``{"scores": [float | null], "reward": name}``, plus ``"notes"`` and ``"metrics"`` when the reward returns a
  `flowgrpo.rewards.RewardOutput` (per-image notes and metric values, e.g. GenEval's reasons and per-task accuracy)

Errors are JSON ``{"error": message}`` with status 400 (bad request), 401 (missing/wrong token),
404 (unknown path or reward), 411/413 (no or too large ``Content-Length``) or 500 (the reward raised or
returned the wrong number of scores). A score the reward could not compute (``None``, NaN or inf) is
sent as ``null``. Requests are handled in threads; each reward is called under its own lock because
scorers (OCR engines, models) are not generally thread-safe. Only JSON is parsed; nothing is unpickled.
"""

from __future__ import annotations

import argparse
import hmac
import importlib
import json
import logging
import math
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .remote import DEFAULT_TOKEN_ENV, decode_image

logger = logging.getLogger(__name__)

__all__ = ["RewardServer", "build_arg_parser", "main", "serve", "server_from_args"]

DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _resolve(name: str, kwargs: Mapping[str, Any]) -> Callable:
    """A registered reward name, or a ``package.module:function`` dotted path."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        obj = getattr(importlib.import_module(module_name), attr)
        return obj(**kwargs) if isinstance(obj, type) else obj
    from .registry import get_reward

    return get_reward(name, **kwargs)


def _to_score(value: Any, reward: str, index: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise _HTTPError(500, f"reward {reward!r} returned a bool for item {index}; expected a number or None")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise _HTTPError(500, f"reward {reward!r} returned {value!r} for item {index}; expected a number or None") from None
    return f if math.isfinite(f) else None


def _decode_image_row(value: Any, column: str, index: int) -> Any:
    """One row of an image column: a base64 image, a list of them, or null."""
    try:
        if value is None:
            return None
        if isinstance(value, list):
            return [decode_image(v) for v in value]
        return decode_image(value)
    except ValueError as exc:
        raise _HTTPError(400, f"image column {column!r}, row {index}: {exc}") from None


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "flowgrpo-reward-server"
    timeout = 120  # seconds a client may take to send its request before the connection is dropped

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send_json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def _check_auth(self) -> None:
        token = self.server.token
        if not token:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise _HTTPError(401, "missing or wrong bearer token")

    def _dispatch(self, fn: Callable[[], Any]) -> None:
        try:
            self._check_auth()
            self._send_json(200, fn())
        except _HTTPError as exc:
            if exc.status >= 500:
                logger.error("reward server: %s", exc.message)
            self._send_json(exc.status, {"error": exc.message})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # never let a request kill the server; report it to the client
            logger.exception("reward server: unexpected error")
            try:
                self._send_json(500, {"error": f"{type(exc).__name__}: {exc}"})
            except OSError:
                pass

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._dispatch(self.server.health)
        else:
            self._dispatch(self._not_found)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/score":
            self._dispatch(self._score)
        else:
            self._dispatch(self._not_found)

    def _not_found(self) -> Any:
        raise _HTTPError(404, f"unknown path {self.path!r}; use GET /health or POST /score")

    def _discard_body(self, n_bytes: int, limit: int = 64 * 2**20) -> None:
        # Read (and drop) a refused body so the client sees the 413 rather than a connection reset.
        remaining = min(max(n_bytes, 0), limit)
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 2**20))
            if not chunk:
                break
            remaining -= len(chunk)

    def _score(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HTTPError(411, "a Content-Length header is required")
        try:
            n_bytes = int(length)
        except ValueError:
            raise _HTTPError(400, f"bad Content-Length {length!r}") from None
        if n_bytes < 0 or n_bytes > self.server.max_request_bytes:
            self.close_connection = True
            self._discard_body(n_bytes)
            raise _HTTPError(
                413,
                f"request of {n_bytes} bytes exceeds this server's limit of {self.server.max_request_bytes} bytes; "
                "send fewer images per request (the client's batch_size) or raise --max-request-mb",
            )
        raw = self.rfile.read(n_bytes)
        try:
            request = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _HTTPError(400, f"the body is not valid JSON: {exc}") from None
        return self.server.score_request(request)


class RewardServer(ThreadingHTTPServer):
    """A threaded HTTP server that scores images with registered rewards. Create it with `serve`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        rewards: Mapping[str, Callable],
        host: str = "127.0.0.1",
        port: int = 8000,
        token: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        if not rewards:
            raise ValueError("a reward server needs at least one reward to serve")
        self.rewards = dict(rewards)
        self.default_reward = next(iter(self.rewards))
        self.token = token or None
        self.max_request_bytes = int(max_request_bytes)
        self._locks = {name: threading.Lock() for name in self.rewards}
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup that can stall offline); skip it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        self._serving.set()
        try:
            super().serve_forever(poll_interval)
        finally:
            self._serving.clear()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def health(self) -> dict:
        return {"status": "ok", "rewards": list(self.rewards), "default": self.default_reward}

    def score_request(self, request: Any) -> dict:
        """Validate one decoded ``/score`` request, score it and return the answer object."""
        if not isinstance(request, dict):
            raise _HTTPError(400, "the body must be a JSON object")
        name = request.get("reward") or self.default_reward
        if name not in self.rewards:
            raise _HTTPError(404, f"unknown reward {name!r}; this server serves {list(self.rewards)}")
        prompts, images = request.get("prompts"), request.get("images")
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise _HTTPError(400, "'prompts' must be a list of strings")
        if not isinstance(images, list) or len(images) != len(prompts):
            raise _HTTPError(400, f"'images' must be a list of {len(prompts)} base64 strings (one per prompt; a "
                                  f"video is a list of base64 frames)")
        columns = request.get("columns") or {}
        if not isinstance(columns, dict):
            raise _HTTPError(400, "'columns' must be an object of lists")
        for key, values in columns.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise _HTTPError(400, f"column {key!r} must be a list of {len(prompts)} values")
            if key in ("prompts", "images"):
                raise _HTTPError(400, f"column name {key!r} is reserved")
        image_columns = request.get("image_columns") or {}
        if not isinstance(image_columns, dict):
            raise _HTTPError(400, "'image_columns' must be an object of lists of base64 images")
        for key, values in image_columns.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise _HTTPError(400, f"image column {key!r} must be a list of {len(prompts)} values")
            if key in columns or key in ("prompts", "images"):
                raise _HTTPError(400, f"image column name {key!r} is reserved or also a plain column")
            columns[key] = [_decode_image_row(v, key, i) for i, v in enumerate(values)]
        decoded: list[Any] = []
        for i, data in enumerate(images):
            try:
                if isinstance(data, list):  # a video: its frames, in order
                    if not data:
                        raise ValueError("a video needs at least one frame")
                    decoded.append([decode_image(frame) for frame in data])
                else:
                    decoded.append(decode_image(data))
            except ValueError as exc:
                raise _HTTPError(400, f"image {i}: {exc}") from None
        if not prompts:
            return {"scores": [], "reward": name}
        start = time.perf_counter()
        try:
            with self._locks[name]:
                raw_scores_obj = self.rewards[name](prompts, decoded, **columns)
        except Exception as exc:
            logger.exception("reward %r raised", name)
            raise _HTTPError(500, f"reward {name!r} raised {type(exc).__name__}: {exc}") from None
        raw_scores = list(raw_scores_obj)
        if len(raw_scores) != len(prompts):
            raise _HTTPError(500, f"reward {name!r} returned {len(raw_scores)} scores for {len(prompts)} images")
        scores = [_to_score(s, name, i) for i, s in enumerate(raw_scores)]
        logger.info("scored %d images with %r in %.3f s", len(scores), name, time.perf_counter() - start)
        answer: dict[str, Any] = {"scores": scores, "reward": name}
        if isinstance(getattr(raw_scores_obj, "notes", None), list):
            answer["notes"] = [None if n is None else str(n) for n in raw_scores_obj.notes]
        if isinstance(getattr(raw_scores_obj, "metrics", None), dict):
            answer["metrics"] = {str(k): [_to_score(v, name, i) for i, v in enumerate(vals)]
                                 for k, vals in raw_scores_obj.metrics.items()}
        return answer

    def start(self) -> RewardServer:
        """Serve from a background daemon thread; returns ``self`` (call `shutdown` to stop)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever, kwargs={"poll_interval": 0.1}, name="flowgrpo-reward-server", daemon=True
            )
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving (from any thread but the serving one) and close the socket."""
        if self._serving.is_set() or self._thread is not None:
            super().shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def serve(
    rewards: Sequence[str] | Mapping[str, Callable],
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    token_env: str | None = DEFAULT_TOKEN_ENV,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    background: bool = True,
) -> RewardServer:
    """Build the rewards and serve them over HTTP.

    Args:
        rewards: registered reward names (or ``package.module:function`` paths), or a mapping from the
            served name to an already-built reward callable. The first one is the default.
        host, port: where to listen; ``port=0`` picks a free port (read it from ``server.url``).
        token: bearer token clients must send. ``None`` reads it from ``$token_env`` (if set);
            ``""`` disables authentication.
        reward_kwargs: ``{name: {kwarg: value}}`` passed to `get_reward` for each named reward.
        max_request_bytes: larger ``/score`` bodies are refused with HTTP 413.
        background: serve from a daemon thread and return at once (call ``server.shutdown()`` to stop);
            ``False`` blocks in ``serve_forever`` until shut down, then closes the socket.
    """
    reward_kwargs = dict(reward_kwargs or {})
    if isinstance(rewards, Mapping):
        if reward_kwargs:
            raise ValueError("reward_kwargs only applies to rewards given by name; these rewards are already built")
        built = dict(rewards)
    else:
        if isinstance(rewards, str):
            rewards = [rewards]
        unknown = set(reward_kwargs) - set(rewards)
        if unknown:
            raise ValueError(f"reward_kwargs given for {sorted(unknown)}, which are not among the served rewards {list(rewards)}")
        built = {name: _resolve(name, reward_kwargs.get(name, {})) for name in rewards}
    if token is None and token_env:
        token = os.environ.get(token_env) or None
    server = RewardServer(built, host=host, port=port, token=token, max_request_bytes=max_request_bytes)
    if not server.token and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("reward server on %s:%s has no token: anyone who can reach it can use it", host, port)
    if background:
        return server.start()
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return server


def build_arg_parser() -> argparse.ArgumentParser:
    """The command-line interface of `main`."""
    parser = argparse.ArgumentParser(
        prog="flowgrpo-reward-server",
        description="Serve registered flowgrpo rewards over HTTP for the `remote` reward client.",
    )
    parser.add_argument("--rewards", nargs="+", required=True,
                        help="registered reward names (or package.module:function paths); the first is the default")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 to accept other machines)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port)")
    parser.add_argument("--token-env", default=DEFAULT_TOKEN_ENV,
                        help="environment variable holding the bearer token clients must send (unset = no auth)")
    parser.add_argument("--reward-kwargs", default=None,
                        help='JSON object of constructor arguments per reward, e.g. \'{"ocr": {"backend": "rapidocr"}}\'')
    parser.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_BYTES / 2**20,
                        help="refuse /score bodies larger than this many MiB")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG logs every request)")
    return parser


def server_from_args(args: argparse.Namespace) -> RewardServer:
    """Build and start (in a background thread) the server described by parsed command-line arguments."""
    reward_kwargs = None
    if args.reward_kwargs:
        try:
            reward_kwargs = json.loads(args.reward_kwargs)
        except ValueError as exc:
            raise SystemExit(f"--reward-kwargs is not valid JSON: {exc}") from None
        if not isinstance(reward_kwargs, dict) or not all(isinstance(v, dict) for v in reward_kwargs.values()):
            raise SystemExit("--reward-kwargs must be a JSON object mapping reward names to objects of arguments")
    return serve(
        args.rewards,
        host=args.host,
        port=args.port,
        reward_kwargs=reward_kwargs,
        token_env=args.token_env,
        max_request_bytes=int(args.max_request_mb * 2**20),
        background=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``flowgrpo-reward-server --rewards ocr jpeg_compressibility --port 8000``; Ctrl-C stops it."""
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = server_from_args(args)
    auth = f"token from ${args.token_env}" if server.token else "no token"
    logger.info("serving %s on http://%s:%d (%s)", list(server.rewards), args.host, server.server_address[1], auth)
    try:
        while server._thread is not None and server._thread.is_alive():
            server._thread.join(timeout=1.0)
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
