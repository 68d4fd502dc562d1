"""`remote`: score images with a reward that runs on another process or machine, over JSON/HTTP.

The other end is a reward server (`flowgrpo-reward-server`, see `flowgrpo.rewards.server`) that serves
any registered reward(s), so an OCR engine or a GenEval-style detector can live on another machine.

Protocol (JSON only; nothing received over the network is ever unpickled)::

    GET  /health  -> {"status": "ok", "rewards": ["ocr", ...], "default": "ocr"}
    POST /score   <- {"prompts": [str], "images": [base64 str | [base64 str]], "image_format": "png" | "jpeg",
                      "columns": {name: [value, ...]}, "reward": str | null,
                      "image_columns": {name: [base64 str | [base64 str, ...] | null, ...]}}
                  -> {"scores": [float | null], "reward": "ocr"}
                     (+ "notes": [str | null], "metrics": {key: [float | null]} when the served reward gives them;
                      the client then returns a `flowgrpo.rewards.RewardOutput`)

Columns of PIL images (an editing dataset's ``image`` column: the source of each edit) travel in ``image_columns``,
each image encoded like the scored images (a row may hold one image, a list of them, or null); the server decodes
them back into PIL images before calling the reward. Columns of numpy arrays (the generated ``audio``) travel as
nested JSON lists of numbers (float32 values survive the round trip exactly).

A sample that is a video (a list of frames) is sent as the list of its encoded frames; a client built with
``accepts_video=True`` receives whole videos from `flowgrpo.rewards.RewardSet` (for a served video reward such as
``videoalign``), otherwise the set scores the frames one by one.

When the server has a token configured, both endpoints require ``Authorization: Bearer <token>``.
``"reward": null`` selects the server's default reward (the first one it serves).

Failure policy of the client:

* Connection errors, timeouts, HTTP 429 and 5xx are retried ``max_retries`` times with exponential
  backoff (``backoff * 2**attempt`` seconds, capped at ``max_backoff``). When they persist the call
  raises `RemoteRewardConnectionError` (`RemoteRewardTimeoutError` for timeouts) or
  `RemoteRewardHTTPError`, or, with ``on_failure="skip"`` (``"none"`` is the same), logs a warning and returns
  ``None`` for every image of the failed request (excluded from the statistics, never counted as 0, reported to
  `flowgrpo.rewards.failures` so that training logs them as ``rewards/<name>/failed``). Leaving
  ``on_failure="raise"`` here and setting the trainer's ``reward_on_failure`` does the same for a whole batch.
* HTTP 401/403 (missing or wrong token) raise `RemoteRewardAuthError` at once; other 4xx raise
  `RemoteRewardHTTPError` at once with the server's message. These are configuration errors: they are
  never retried and ``on_failure`` does not hide them.
* A malformed body (not JSON, no ``scores`` list, wrong length, a score that is neither a finite number
  nor null) raises `RemoteRewardProtocolError` at once, whatever ``on_failure`` says.
* ``null`` scores are the server's way to say "could not score this image": they become ``None``.
* Every request has a hard deadline of ``timeout`` seconds (connection, upload and download together),
  enforced by a watchdog that shuts the socket down, so a stalled or trickling server never hangs training.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from .failures import normalize_on_failure, report_failed_samples
from .registry import register_reward

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TOKEN_ENV",
    "RemoteReward",
    "RemoteRewardAuthError",
    "RemoteRewardConnectionError",
    "RemoteRewardError",
    "RemoteRewardHTTPError",
    "RemoteRewardProtocolError",
    "RemoteRewardTimeoutError",
    "decode_image",
    "encode_image",
    "request_json",
]

DEFAULT_TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
_IMAGE_COLUMN_PREFIX = "\0image:"  # marks an encoded image column inside the client (never sent as a name)
IMAGE_FORMATS = ("png", "jpeg")
_SERVER_HINT = (
    "Start a reward server with `flowgrpo-reward-server --rewards ocr --host 0.0.0.0 --port 8000` "
    "(or `python scripts/reward_server.py ...`) on the scoring machine, check the URL and firewall, "
    "or pass health_check=False to skip this start-up check."
)


class RemoteRewardError(RuntimeError):
    """Base class of every error raised by the remote reward client."""


class RemoteRewardConnectionError(RemoteRewardError):
    """The server could not be reached (or kept failing) after all retries."""


class RemoteRewardTimeoutError(RemoteRewardConnectionError):
    """A request ran past its deadline on every attempt."""


class RemoteRewardAuthError(RemoteRewardError):
    """The server refused the bearer token (HTTP 401/403)."""


class RemoteRewardHTTPError(RemoteRewardError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RemoteRewardProtocolError(RemoteRewardError):
    """The server answered with a body that does not follow the protocol."""


# --------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------


def encode_image(image: Image.Image, image_format: str = "png", jpeg_quality: int = 95) -> str:
    """Encode a PIL image as base64 PNG (lossless, the default) or JPEG (smaller, lossy)."""
    fmt = image_format.lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    buf = io.BytesIO()
    if fmt == "png":
        img = image if image.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16") else image.convert("RGB")
        img.save(buf, format="PNG", compress_level=1)
    else:
        img = image if image.mode in ("L", "RGB") else image.convert("RGB")
        img.save(buf, format="JPEG", quality=jpeg_quality)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_image(data: str) -> Image.Image:
    """Decode a base64 PNG or JPEG (other formats are refused) into a loaded PIL image."""
    if not isinstance(data, str):
        raise ValueError(f"an image must be a base64 string, got {type(data).__name__}")
    if data.startswith("data:"):  # tolerate data URLs
        data = data.split(",", 1)[-1]
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid base64 image data: {exc}") from exc
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG", "JPEG"])
        img.load()
    except Exception as exc:  # PIL raises several types for corrupt data
        raise ValueError(f"could not decode the image (PNG or JPEG expected): {exc}") from exc
    return img


# --------------------------------------------------------------------------------------------------
# HTTP with a hard deadline, retries and backoff (shared with the VLM judge)
# --------------------------------------------------------------------------------------------------


class _Transport(Exception):
    """A transport-level failure of one attempt (retryable)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON here")


def _http_once(
    method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout: float, max_response_bytes: int
) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body). Raises `_Transport` on any transport failure.

    ``timeout`` is a hard deadline for the whole exchange: the socket timeout bounds every single
    operation and a watchdog timer shuts the socket down when the total time runs out.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    fired = threading.Event()
    opened: list[socket.socket] = []  # the connection drops its `sock` once a closing response arrives

    def _abort() -> None:
        fired.set()
        for sock in opened or ([conn.sock] if conn.sock is not None else []):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, _abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        opened.append(conn.sock)
        if fired.is_set():
            _abort()
        conn.request(method, path, body=body, headers=dict(headers))
        resp = conn.getresponse()
        chunks, size = [], 0
        while True:
            chunk = resp.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_response_bytes:
                raise RemoteRewardProtocolError(
                    f"response from {url} is larger than max_response_bytes={max_response_bytes}"
                )
            chunks.append(chunk)
        if fired.is_set():
            raise _Transport(f"timed out after {timeout:g} s", timed_out=True)
        return resp.status, b"".join(chunks)
    except (OSError, http.client.HTTPException) as exc:
        timed_out = fired.is_set() or isinstance(exc, (TimeoutError, socket.timeout))
        if timed_out:
            raise _Transport(f"timed out after {timeout:g} s", timed_out=True) from exc
        raise _Transport(f"{type(exc).__name__}: {exc}") from exc
    finally:
        watchdog.cancel()
        conn.close()


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])
    except ValueError:
        pass
    text = body[:300].decode("utf-8", "replace").strip()
    return text or "(empty body)"


def request_json(
    method: str,
    url: str,
    payload: Any = None,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    max_retries: int = 3,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    max_response_bytes: int = 64 * 2**20,
    auth_hint: str = "",
) -> Any:
    """Send ``payload`` as JSON and return the decoded JSON answer, following the policy in the module doc.

    Retries connection errors, timeouts, 429 and 5xx; raises at once on 401/403, other 4xx and bodies
    that are not JSON. Never unpickles anything.
    """
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    all_headers = {"Accept": "application/json"}
    body = None
    if payload is not None:
        body = json.dumps(payload, allow_nan=False).encode("utf-8")
        all_headers["Content-Type"] = "application/json"
    all_headers.update(headers or {})
    last_error: RemoteRewardError | None = None
    for attempt in range(max_retries + 1):
        if attempt:
            delay = min(max_backoff, backoff * 2 ** (attempt - 1))
            logger.warning("%s %s failed (%s); retry %d/%d in %.2f s", method, url, last_error, attempt, max_retries, delay)
            time.sleep(delay)
        try:
            status, data = _http_once(method, url, body, all_headers, timeout, max_response_bytes)
        except _Transport as exc:
            cls = RemoteRewardTimeoutError if exc.timed_out else RemoteRewardConnectionError
            last_error = cls(f"{method} {url}: {exc}")
            continue
        if status in (401, 403):
            raise RemoteRewardAuthError(
                f"{method} {url} was refused with HTTP {status} ({_error_message(data)}): missing or wrong token. "
                f"{auth_hint}".strip()
            )
        if status == 429 or status >= 500:
            last_error = RemoteRewardHTTPError(f"{method} {url}: HTTP {status}: {_error_message(data)}", status)
            continue
        if status >= 400:
            raise RemoteRewardHTTPError(f"{method} {url}: HTTP {status}: {_error_message(data)}", status)
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            snippet = data[:200].decode("utf-8", "replace")
            raise RemoteRewardProtocolError(f"{method} {url} did not return valid JSON ({exc}); body starts {snippet!r}") from exc
    assert last_error is not None
    attempts = max_retries + 1
    raise type(last_error)(
        f"{last_error} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})",
        *((last_error.status,) if isinstance(last_error, RemoteRewardHTTPError) else ()),
    ) from last_error


# --------------------------------------------------------------------------------------------------
# The reward
# --------------------------------------------------------------------------------------------------


def _jsonable_column(name: str, values: Any) -> list | None:
    """Convert one dataset column to a JSON-serialisable list, or None if it cannot be sent."""
    if hasattr(values, "tolist"):  # numpy arrays, torch tensors
        values = values.tolist()
    values = list(values)
    out = []
    for v in values:
        if hasattr(v, "tolist"):
            v = v.tolist()
        out.append(v)
    try:
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return out


def _validate_scores(obj: Any, n: int, url: str, expected_reward: str | None) -> list[float | None]:
    if not isinstance(obj, dict) or "scores" not in obj:
        raise RemoteRewardProtocolError(f"the answer of {url} has no 'scores' field: {str(obj)[:200]!r}")
    scores = obj["scores"]
    if not isinstance(scores, list):
        raise RemoteRewardProtocolError(f"'scores' from {url} must be a list, got {type(scores).__name__}")
    if len(scores) != n:
        raise RemoteRewardProtocolError(f"{url} returned {len(scores)} scores for {n} images")
    if expected_reward is not None and obj.get("reward", expected_reward) != expected_reward:
        raise RemoteRewardProtocolError(f"{url} scored with reward {obj.get('reward')!r}, asked for {expected_reward!r}")
    out: list[float | None] = []
    for i, s in enumerate(scores):
        if s is None:
            out.append(None)
        elif isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s):
            out.append(float(s))
        else:
            raise RemoteRewardProtocolError(f"score {i} from {url} is {s!r}; expected a finite number or null")
    return out


@register_reward("remote")
class RemoteReward:
    """Client of a flowgrpo reward server (see the module docstring for the protocol and failure policy).

    Args:
        url: base URL of the server, e.g. ``"http://gpu-node-3:8000"``.
        reward_name: which of the server's rewards to use; ``None`` = the server's default (its first).
        token_env: environment variable holding the bearer token; no header is sent when it is unset/empty.
        image_format: ``"png"`` (lossless: scores equal the in-process reward) or ``"jpeg"`` (smaller).
        jpeg_quality: quality used when ``image_format="jpeg"``.
        timeout: hard deadline in seconds for each HTTP request (connect + upload + scoring + download).
        max_retries: retries after the first attempt for connection errors, timeouts, 429 and 5xx.
        backoff: first retry delay in seconds; doubles on each retry, capped at ``max_backoff``.
        batch_size: images per request (``None`` = everything in one request).
        health_check: ``GET /health`` at construction so an unreachable server, a wrong token or an
            unknown reward name is a clear error before training starts.
        health_timeout: deadline for the health check (defaults to ``min(timeout, 10)``).
        on_failure: ``"raise"`` (default) or ``"skip"`` (``"none"`` is the same): what to do when transport
            failures persist after the retries (``"skip"`` logs a warning and returns ``None`` for the failed
            images).
        max_response_bytes: refuse answers larger than this.
        accepts_audio: declare that the served reward scores sound (e.g. ``clap``), so that the trainer decodes the
            generated audio and sends the ``audio`` / ``audio_sampling_rate`` columns to it.
        accepts_video: the served reward scores whole videos (``videoalign``): each video is sent as the list of its
            frames instead of frame by frame.
    """

    def __init__(
        self,
        url: str,
        reward_name: str | None = None,
        token_env: str | None = DEFAULT_TOKEN_ENV,
        image_format: str = "png",
        jpeg_quality: int = 95,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        batch_size: int | None = None,
        health_check: bool = True,
        health_timeout: float | None = None,
        on_failure: str = "raise",
        max_response_bytes: int = 16 * 2**20,
        accepts_audio: bool = False,
        accepts_video: bool = False,
    ):
        parts = urllib.parse.urlsplit(url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must look like 'http://host:port', got {url!r}")
        self.url = url.rstrip("/")
        fmt = image_format.lower()
        fmt = "jpeg" if fmt == "jpg" else fmt
        if fmt not in IMAGE_FORMATS:
            raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        on_failure = normalize_on_failure(on_failure)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.reward_name = reward_name
        self.accepts_video = bool(accepts_video)
        self.token_env = token_env
        self.image_format = fmt
        self.jpeg_quality = jpeg_quality
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.batch_size = batch_size
        self.on_failure = on_failure
        self.max_response_bytes = int(max_response_bytes)
        self.accepts_audio = bool(accepts_audio)
        self.health_timeout = float(health_timeout) if health_timeout is not None else min(self.timeout, 10.0)
        self.__name__ = f"remote:{reward_name}" if reward_name else "remote"
        self._warned_columns: set[str] = set()
        self.server_rewards: list[str] | None = None
        if health_check:
            self.check_health()

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, reward_name={self.reward_name!r}, image_format={self.image_format!r})"

    # -- HTTP helpers ---------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        token = os.environ.get(self.token_env, "") if self.token_env else ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _auth_hint(self) -> str:
        if not self.token_env:
            return "The server requires a token: set token_env to the variable that holds it."
        state = "is set" if os.environ.get(self.token_env) else "is not set"
        return f"The client reads the token from ${self.token_env}, which {state}; it must match the server's token."

    def check_health(self) -> dict:
        """``GET /health``; raises a clear error if the server is unreachable or cannot serve ``reward_name``."""
        url = f"{self.url}/health"
        try:
            info = request_json(
                "GET",
                url,
                headers=self._headers(),
                timeout=self.health_timeout,
                max_retries=min(self.max_retries, 2),
                backoff=self.backoff,
                max_backoff=self.max_backoff,
                max_response_bytes=self.max_response_bytes,
                auth_hint=self._auth_hint(),
            )
        except RemoteRewardConnectionError as exc:
            raise type(exc)(f"reward server at {self.url} is unreachable: {exc}. {_SERVER_HINT}") from exc
        except RemoteRewardHTTPError as exc:
            raise RemoteRewardHTTPError(
                f"reward server health check at {url} failed: {exc}. Is {self.url} a flowgrpo reward server?",
                exc.status,
            ) from exc
        if not isinstance(info, dict) or info.get("status") != "ok" or not isinstance(info.get("rewards"), list):
            raise RemoteRewardProtocolError(
                f"{url} did not answer like a flowgrpo reward server (expected {{'status': 'ok', 'rewards': [...]}}, "
                f"got {str(info)[:200]!r})"
            )
        self.server_rewards = [str(r) for r in info["rewards"]]
        if self.reward_name is not None and self.reward_name not in self.server_rewards:
            raise ValueError(
                f"reward server at {self.url} does not serve reward {self.reward_name!r}; it serves "
                f"{self.server_rewards}. Start it with `--rewards {self.reward_name}` or pick one of those."
            )
        return info

    # -- scoring --------------------------------------------------------------------------------

    def _image_column(self, values: Any) -> list | None:
        """A column of PIL images (or lists of them, or None per row) encoded for ``image_columns``; ``None`` when the
        column holds anything else."""
        def is_image_row(v: Any) -> bool:
            return v is None or isinstance(v, Image.Image) or (
                isinstance(v, (list, tuple)) and bool(v) and all(isinstance(x, Image.Image) for x in v))

        values = list(values)
        if not values or not all(is_image_row(v) for v in values) or all(v is None for v in values):
            return None

        def encode(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Image.Image):
                return encode_image(v, self.image_format, self.jpeg_quality)
            return [encode_image(x, self.image_format, self.jpeg_quality) for x in v]

        return [encode(v) for v in values]

    def _columns_payload(self, columns: Mapping[str, Any], n: int) -> dict[str, list]:
        out = {}
        for name, values in columns.items():
            if values is not None:
                encoded = self._image_column(values)
                if encoded is not None:
                    if len(encoded) != n:
                        raise ValueError(f"column {name!r} has {len(encoded)} values for {n} prompts")
                    out[_IMAGE_COLUMN_PREFIX + name] = encoded
                    continue
            converted = _jsonable_column(name, values) if values is not None else None
            if converted is None:
                if name not in self._warned_columns:
                    self._warned_columns.add(name)
                    logger.warning("remote reward: column %r is not JSON-serialisable and is not sent to %s", name, self.url)
                continue
            if len(converted) != n:
                raise ValueError(f"column {name!r} has {len(converted)} values for {n} prompts")
            out[name] = converted
        return out

    def _score_chunk(self, prompts: list[str], images: list[Image.Image], columns: dict[str, list]) -> list[float | None]:
        plain = {k: v for k, v in columns.items() if not k.startswith(_IMAGE_COLUMN_PREFIX)}
        image_columns = {k[len(_IMAGE_COLUMN_PREFIX):]: v for k, v in columns.items()
                         if k.startswith(_IMAGE_COLUMN_PREFIX)}
        payload = {
            "prompts": list(prompts),
            "images": [[encode_image(frame, self.image_format, self.jpeg_quality) for frame in img]
                       if isinstance(img, (list, tuple)) else encode_image(img, self.image_format, self.jpeg_quality)
                       for img in images],
            "image_format": self.image_format,
            "columns": plain,
            "reward": self.reward_name,
        }
        if image_columns:
            payload["image_columns"] = image_columns
        url = f"{self.url}/score"
        try:
            obj = request_json(
                "POST",
                url,
                payload,
                headers=self._headers(),
                timeout=self.timeout,
                max_retries=self.max_retries,
                backoff=self.backoff,
                max_backoff=self.max_backoff,
                max_response_bytes=self.max_response_bytes,
                auth_hint=self._auth_hint(),
            )
        except (RemoteRewardConnectionError, RemoteRewardHTTPError) as exc:
            retryable = not isinstance(exc, RemoteRewardHTTPError) or exc.status == 429 or exc.status >= 500
            if self.on_failure == "skip" and retryable:
                logger.warning("remote reward %s: %s; %d images scored None", self.__name__, exc, len(prompts))
                report_failed_samples(len(prompts))
                return [None] * len(prompts)
            if isinstance(exc, RemoteRewardHTTPError) and exc.status == 413:
                raise RemoteRewardHTTPError(f"{exc} (this request held {len(prompts)} images)", 413) from exc
            raise
        scores = _validate_scores(obj, len(prompts), url, self.reward_name)
        if isinstance(obj.get("notes"), list) or isinstance(obj.get("metrics"), dict):
            from .composition import RewardOutput

            notes = obj.get("notes") if isinstance(obj.get("notes"), list) else None
            metrics = obj.get("metrics") if isinstance(obj.get("metrics"), dict) else None
            try:
                return RewardOutput(scores, notes=notes, metrics=metrics)
            except ValueError as exc:
                raise RemoteRewardProtocolError(f"{url}: {exc}") from None
        return scores

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **columns: Any) -> list[float | None]:
        prompts, images = list(prompts), list(images)
        if len(prompts) != len(images):
            raise ValueError(f"got {len(prompts)} prompts for {len(images)} images")
        n = len(prompts)
        if n == 0:
            return []
        cols = self._columns_payload(columns, n)
        step = self.batch_size or n
        chunks = [self._score_chunk(prompts[s:s + step], images[s:s + step], {k: v[s:s + step] for k, v in cols.items()})
                  for s in range(0, n, step)]
        scores: list[float | None] = [v for chunk in chunks for v in chunk]
        if any(hasattr(chunk, "notes") for chunk in chunks):
            from .composition import RewardOutput

            notes = [note for chunk in chunks for note in getattr(chunk, "notes", [None] * len(chunk))]
            keys = dict.fromkeys(k for chunk in chunks for k in getattr(chunk, "metrics", {}))
            metrics = {k: [v for chunk in chunks for v in getattr(chunk, "metrics", {}).get(k, [None] * len(chunk))]
                       for k in keys}
            return RewardOutput(scores, notes=notes, metrics=metrics)
        return scores
