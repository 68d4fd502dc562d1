"""`vlm_judge`: a vision-language model grades each image through an OpenAI-compatible chat-completions API.

vLLM (``vllm serve Qwen/Qwen2.5-VL-7B-Instruct``), sglang and hosted OpenAI-compatible services all speak it.
For each (prompt, image) pair the judge sends::

    POST {base_url}/chat/completions
    {"model": model, "temperature": 0.0, "max_tokens": 64,
     "messages": [{"role": "system", "content": system_prompt},              # only if one is given
                  {"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                      {"type": "text", "text": prompt_template.format(prompt=prompt, **row_columns)}]}]}

and turns the first choice's message text into a score in [0, 1] with ``score_parser``. The default
parser (`parse_score`) reads "7/10" -> 0.7, "8 out of 10" -> 0.8, "85%" -> 0.85, "Score: 0.8" -> 0.8
and a bare number in [0, 1]; with ``scale=10`` a bare "7" reads as 0.7. Anything else is ``None``.

Failure policy: unparsable answers, and requests that still fail after ``max_retries`` retries
(connection errors, timeouts, 429, 5xx), score ``None`` for that image with a logged warning
(``on_failure="skip"``, the default, also spelled ``"none"``; failed requests are reported to
`flowgrpo.rewards.failures` and logged in training as ``rewards/<name>/failed``; ``on_failure="raise"`` raises
instead). A refused API key (401/403), other 4xx and malformed JSON
bodies always raise: they are configuration errors that would otherwise silently empty every batch.
At most ``max_concurrency`` requests are in flight at once; each has a hard deadline of ``timeout``.
"""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image

from .failures import normalize_on_failure, report_failed_samples
from .registry import register_reward
from .remote import (
    RemoteRewardConnectionError,
    RemoteRewardHTTPError,
    RemoteRewardProtocolError,
    encode_image,
    request_json,
)

logger = logging.getLogger(__name__)

_FAILED = object()  # a request that kept failing under on_failure="skip" (scored None, counted as failed)

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "VLMJudgeReward", "parse_score"]

DEFAULT_PROMPT_TEMPLATE = (
    'You are grading an image generated for the prompt: "{prompt}".\n'
    "Judge how faithfully and how well the image depicts the prompt. "
    "Answer with a single line of the form 'Score: N/10', where N is an integer from 0 (unrelated or broken) "
    "to 10 (perfect)."
)

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_FRACTION = re.compile(rf"({_NUM})\s*(?:/|\bout\s+of\b)\s*({_NUM})", re.IGNORECASE)
_PERCENT = re.compile(rf"({_NUM})\s*%")
_NUMBER = re.compile(_NUM)
_KEYWORD = re.compile(r"\b(?:score|rating|rated|rate|grade|verdict)\b", re.IGNORECASE)
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)


def _candidates(text: str, scale: float | None) -> list[tuple[int, float | None]]:
    """(position, value in [0, 1] or None) for each score-like span, in text order."""
    found: list[tuple[int, int, float | None]] = []
    taken: list[tuple[int, int]] = []

    def free(span: tuple[int, int]) -> bool:
        return all(span[1] <= a or span[0] >= b for a, b in taken)

    for m in _FRACTION.finditer(text):
        num, den = float(m.group(1)), float(m.group(2))
        found.append((m.start(), m.end(), num / den if den > 0 else None))
        taken.append(m.span())
    for m in _PERCENT.finditer(text):
        if free(m.span()):
            found.append((m.start(), m.end(), float(m.group(1)) / 100.0))
            taken.append(m.span())
    for m in _NUMBER.finditer(text):
        if free(m.span()):
            value = float(m.group(0))
            if scale is not None:
                value = value / scale
            found.append((m.start(), m.end(), value if scale is not None or 0.0 <= value <= 1.0 else None))
            taken.append(m.span())
    found.sort()
    return [(start, value if value is not None and 0.0 <= value <= 1.0 else None) for start, _, value in found]


def parse_score(text: str | None, scale: float | None = None) -> float | None:
    """Read a score in [0, 1] from a judge's answer; ``None`` when there is none.

    Understands fractions ("7/10", "7.5 / 10", "8 out of 10"), percentages ("85%"), and plain numbers
    ("Score: 0.8", "0.35"); a plain number outside [0, 1] needs ``scale`` (``scale=10``: "7" -> 0.7).
    ``<think>...</think>`` blocks are ignored. When a keyword (score, rating, grade, ...) is present, the
    first score-like span after its last occurrence is used; otherwise the last one in the text (judges
    tend to end with the verdict). A value outside [0, 1] gives ``None``.
    """
    if not text:
        return None
    text = _THINK.sub(" ", str(text))
    cands = _candidates(text, scale)
    if not cands:
        return None
    keywords = list(_KEYWORD.finditer(text))
    if keywords:
        after = [c for c in cands if c[0] >= keywords[-1].end()]
        if after:
            return after[0][1]
    return cands[-1][1]


def _message_text(obj: Any, url: str) -> str | None:
    """The text of the first choice of a chat-completions answer (``None`` if the model said nothing)."""
    try:
        message = obj["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise RemoteRewardProtocolError(
            f"{url} did not return a chat completion (no choices[0].message): {str(obj)[:200]!r}"
        ) from None
    if not isinstance(message, dict):
        raise RemoteRewardProtocolError(f"{url}: choices[0].message must be an object, got {type(message).__name__}")
    content = message.get("content")
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content is not None and not isinstance(content, str):
        raise RemoteRewardProtocolError(f"{url}: message content must be a string, got {type(content).__name__}")
    return content


@register_reward("vlm_judge")
class VLMJudgeReward:
    """Score images by asking a vision-language model behind an OpenAI-compatible chat-completions API.

    Args:
        model: the model name the server knows (e.g. ``"Qwen/Qwen2.5-VL-7B-Instruct"``).
        base_url: API root, e.g. ``"http://localhost:8000/v1"`` (``/chat/completions`` is appended; a
            URL that already ends with it is used as is).
        api_key_env: environment variable holding the API key, sent as a bearer token when set.
        prompt_template: the user text; ``{prompt}`` is the generation prompt, and other ``{name}``
            fields are filled from the dataset columns of the same row.
        system_prompt: optional system message.
        score_parser: ``str -> float | None``; defaults to `parse_score` with ``scale``.
        scale: passed to the default parser (e.g. 10 when the judge answers with a bare 0-10 number).
        max_concurrency: requests in flight at once.
        timeout, max_retries, backoff: per-request deadline (s), retries and first retry delay (s).
        image_format: ``"png"`` or ``"jpeg"`` for the data URL.
        max_tokens, temperature: generation settings (``max_tokens=None`` leaves the length to the server);
            ``extra_body`` is merged into every request.
        on_failure: ``"skip"`` (default, also spelled ``"none"``: the image scores ``None``) or ``"raise"``
            when a request keeps failing after the retries.
        health_check: ``GET {base_url}/models`` at construction: an unreachable server is a clear error,
            and if the server lists its models, ``model`` must be one of them.
    """

    def __init__(
        self,
        model: str,
        base_url: str = "http://127.0.0.1:8000/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        system_prompt: str | None = None,
        score_parser: Callable[[str], float | None] | None = None,
        scale: float | None = None,
        max_concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 2,
        backoff: float = 0.5,
        image_format: str = "png",
        max_tokens: int | None = 64,
        temperature: float = 0.0,
        extra_body: dict | None = None,
        on_failure: str = "skip",
        health_check: bool = True,
    ):
        if not model:
            raise ValueError("vlm_judge needs model=<the model name served at base_url>")
        parts = urllib.parse.urlsplit(base_url or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must look like 'http://host:port/v1', got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        on_failure = normalize_on_failure(on_failure)
        if scale is not None and scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if "{prompt}" not in prompt_template:
            logger.warning("vlm_judge: prompt_template has no {prompt} field; the judge will not see the prompt")
        base = base_url.rstrip("/")
        if base.endswith("/chat/completions"):
            self.endpoint = base
            self.base_url = base[: -len("/chat/completions")]
        else:
            self.endpoint = f"{base}/chat/completions"
            self.base_url = base
        self.model = model
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.scale = scale
        self.score_parser = score_parser
        self.max_concurrency = int(max_concurrency)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.image_format = "jpeg" if image_format.lower() in ("jpg", "jpeg") else image_format.lower()
        if self.image_format not in ("png", "jpeg"):
            raise ValueError(f"image_format must be 'png' or 'jpeg', got {image_format!r}")
        if max_tokens is not None and int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None (the server's default), got {max_tokens}")
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.temperature = float(temperature)
        self.extra_body = dict(extra_body or {})
        self.on_failure = on_failure
        self.__name__ = "vlm_judge"
        if health_check:
            self.check_health()

    def __repr__(self) -> str:
        return f"VLMJudgeReward(model={self.model!r}, base_url={self.base_url!r})"

    def _headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _auth_hint(self) -> str:
        if not self.api_key_env:
            return "Set api_key_env to the environment variable that holds the API key."
        state = "is set" if os.environ.get(self.api_key_env) else "is not set"
        return f"The API key is read from ${self.api_key_env}, which {state}."

    def check_health(self) -> None:
        """Raise a clear error if the API is unreachable or (when it lists models) lacks ``model``."""
        url = f"{self.base_url}/models"
        try:
            info = request_json(
                "GET", url, headers=self._headers(), timeout=min(self.timeout, 10.0), max_retries=1,
                backoff=self.backoff, auth_hint=self._auth_hint(),
            )
        except RemoteRewardConnectionError as exc:
            raise type(exc)(
                f"vlm_judge: the chat-completions server at {self.base_url} is unreachable ({exc}). Start one, e.g. "
                f"`vllm serve {self.model} --port 8000`, check base_url, or pass health_check=False."
            ) from exc
        except RemoteRewardHTTPError as exc:
            if exc.status == 404:  # some OpenAI-compatible servers do not implement /models
                logger.warning("vlm_judge: %s has no /models endpoint; cannot check the model name", self.base_url)
                return
            raise
        data = info.get("data") if isinstance(info, dict) else None
        if isinstance(data, list) and data:
            served = [m.get("id") for m in data if isinstance(m, dict)]
            if self.model not in served:
                raise ValueError(f"vlm_judge: model {self.model!r} is not served at {self.base_url}; it serves {served}")

    def build_request(self, prompt: str, image: Image.Image, row: dict[str, Any] | None = None) -> dict:
        """The chat-completions request body for one (prompt, image) pair."""
        fields = dict(row or {})
        fields["prompt"] = prompt
        try:
            text = self.prompt_template.format(**fields)
        except (KeyError, IndexError) as exc:
            raise ValueError(
                f"vlm_judge: prompt_template refers to {exc} which is neither 'prompt' nor a dataset column "
                f"(columns: {sorted(k for k in fields if k != 'prompt')})"
            ) from None
        mime = "image/png" if self.image_format == "png" else "image/jpeg"
        data_url = f"data:{mime};base64,{encode_image(image, self.image_format)}"
        messages: list[dict] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url}},
                    {"type": "text", "text": text},
                ],
            }
        )
        body = {"model": self.model, "messages": messages, "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    def _parse(self, text: str | None) -> float | None:
        if text is None:
            return None
        if self.score_parser is not None:
            value = self.score_parser(text)
        else:
            value = parse_score(text, scale=self.scale)
        return None if value is None else float(value)

    def _request_text(self, body: dict) -> str | None | object:
        """The first choice's text for one request body; `_FAILED` for a request that kept failing under
        ``on_failure="skip"`` (a failure it must not hide raises)."""
        try:
            obj = request_json(
                "POST", self.endpoint, body, headers=self._headers(), timeout=self.timeout,
                max_retries=self.max_retries, backoff=self.backoff, auth_hint=self._auth_hint(),
            )
        except (RemoteRewardConnectionError, RemoteRewardHTTPError) as exc:
            retryable = not isinstance(exc, RemoteRewardHTTPError) or exc.status == 429 or exc.status >= 500
            if self.on_failure == "skip" and retryable:
                logger.warning("vlm_judge: %s; this image scores None", exc)
                return _FAILED
            raise
        return _message_text(obj, self.endpoint)

    def complete_many(self, bodies: Sequence[dict]) -> tuple[list[str | None], list[bool]]:
        """Send several chat-completions request bodies (at most ``max_concurrency`` in flight) and return each
        answer's text (``None`` when the model said nothing or the request failed) and whether it failed (a request
        that kept failing under ``on_failure="skip"``; other failures raise). Failures are not reported here: the
        caller counts its failed samples."""
        if not bodies:
            return [], []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies)),
                                thread_name_prefix="vlm_judge") as pool:
            answers = list(pool.map(self._request_text, bodies))
        failed = [a is _FAILED for a in answers]
        return [None if f else a for a, f in zip(answers, failed)], failed

    def _score_one(self, body: dict) -> float | None | object:
        text = self._request_text(body)
        if text is _FAILED:
            return _FAILED
        score = self._parse(text)
        if score is None:
            logger.warning("vlm_judge: could not read a score from %r; this image scores None", (text or "")[:200])
        return score

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **columns: Any) -> list[float | None]:
        prompts, images = list(prompts), list(images)
        if len(prompts) != len(images):
            raise ValueError(f"got {len(prompts)} prompts for {len(images)} images")
        for name, values in columns.items():
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"column {name!r} has {len(values)} values for {len(prompts)} prompts")
        bodies = [
            self.build_request(p, img, {k: v[i] for k, v in columns.items() if v is not None})
            for i, (p, img) in enumerate(zip(prompts, images))
        ]
        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(bodies)), thread_name_prefix="vlm_judge") as pool:
            scores = list(pool.map(self._score_one, bodies))
        report_failed_samples(sum(s is _FAILED for s in scores))
        return [None if s is _FAILED else s for s in scores]
