"""`clap`: CLAP (LAION, ``laion/larger_clap_general`` by default) text-audio agreement of generated sound.

For each sample the reward is the cosine between the normalised audio and text embeddings of transformers'
``ClapModel``::

    reward = <a / |a|, t / |t|>,   a = audio_projection(HTSAT(mel(audio))),   t = text_projection(RoBERTa(prompt))

in [-1, 1], higher is better (Flow-Factory's CLAP reward for LTX-2's soundtrack).

The sound reaches the reward as the trainer decodes it (`flowgrpo.rewards.composition`): the ``audio`` column, one
float32 ``(channels, samples)`` array per sample, and ``audio_sampling_rate``. Before the feature extractor each
waveform is

* downmixed to mono (the mean of its channels);
* resampled to the checkpoint's rate (48 kHz for ``larger_clap_general``; LTX-2's vocoder writes 24 kHz) with
  scipy's polyphase resampler (``scipy.signal.resample_poly``: an FIR low-pass with a Kaiser window, beta 5, at the
  rational ratio ``target / source`` reduced by their gcd), in float64, then cast back to float32;
* given to the checkpoint's own feature extractor with its own settings: ``larger_clap_general`` pads audio
  shorter than 10 s with ``repeatpad`` (the clip tiled, then zero-filled to 480000 samples) and truncates longer
  audio with ``rand_trunc`` (a random 10 s window, drawn from numpy's global generator as the extractor does).

Two CLAP callers among the peers pass ``padding=True`` to the processor. Under the transformers 4.x releases they
run with, that does not mean "the default padding": the extractor then skips ``repeatpad`` and zero-fills instead,
which changes the mel input and the score of every clip shorter than 10 s (transformers 5 reads ``True`` as the
checkpoint's setting). ``padding`` here is ``None`` (the checkpoint's setting) unless asked for; ``padding=True`` (or
``"zero"``) reproduces the peers' zero padding on any transformers release: the waveform is zero-filled to the
extractor's length before the extractor sees it, exactly what the 4.x extractor does.

The model runs in float32 by default (its audio encoder's batch norms are kept in float32 by the peers too). Memory:
about 0.8 GB of weights (``larger_clap_general``: 193 M parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .placement import ModelReward
from .registry import register_reward

__all__ = ["DEFAULT_CLAP_MODEL", "CLAPReward", "resample_audio", "to_mono"]

DEFAULT_CLAP_MODEL = "laion/larger_clap_general"


def to_mono(waveform: Any) -> Any:
    """A ``(samples,)`` float32 numpy array: the mean over channels of a ``(channels, samples)`` array (a 1-D array
    is already mono).

    Raises:
        ValueError: more than two dimensions, or no samples.
    """
    import numpy as np

    array = np.asarray(waveform, dtype=np.float32)
    if array.ndim == 2:
        array = array.mean(axis=0, dtype=np.float64).astype(np.float32)
    elif array.ndim != 1:
        raise ValueError(f"audio must be (channels, samples) or (samples,), got shape {array.shape}")
    if array.shape[0] == 0:
        raise ValueError("audio has no samples")
    return array


def resample_audio(waveform: Any, source_rate: int, target_rate: int) -> Any:
    """``waveform`` (1-D) resampled from ``source_rate`` to ``target_rate`` with ``scipy.signal.resample_poly`` at the
    reduced ratio ``(target / g) / (source / g)``, ``g = gcd``; float32 out. Equal rates return the input."""
    import numpy as np

    source_rate, target_rate = int(source_rate), int(target_rate)
    if source_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sampling rates must be positive, got {source_rate} and {target_rate}")
    array = np.asarray(waveform, dtype=np.float32)
    if source_rate == target_rate:
        return array
    from scipy.signal import resample_poly

    g = math.gcd(source_rate, target_rate)
    return resample_poly(array.astype(np.float64), target_rate // g, source_rate // g).astype(np.float32)


@register_reward("clap")
class CLAPReward(ModelReward):
    """The CLAP cosine of each (prompt, generated sound) pair (see the module docstring).

    Called as ``reward(prompts, videos_or_images, audio=[...], audio_sampling_rate=[...])``: the pictures are not
    used; ``audio`` holds one ``(channels, samples)`` array per sample.

    Args:
        model_name_or_path: a ``ClapModel`` checkpoint with its processor (hub id or local folder; default
            ``laion/larger_clap_general``).
        padding: ``None`` (default): the feature extractor's own padding (``repeatpad`` for the LAION checkpoints);
            ``True`` or ``"zero"``: zero padding, what ``processor(..., padding=True)`` does under transformers 4.x,
            as two peers call it; or ``"repeatpad"`` / ``"repeat"``.
        device (alias ``reward_device``), dtype (default float32), batch_size: placement and chunking.
    """

    accepts_audio = True
    accepts_video = True  # a video sample is scored once by its sound, not frame by frame

    def __init__(self, model_name_or_path: str = DEFAULT_CLAP_MODEL, padding: bool | str | None = None,
                 device: str | None = None, dtype: Any = None, batch_size: int = 16, reward_device: str | None = None):
        if padding is False:
            padding = None
        if padding is True:
            padding = "zero"
        if padding is not None and padding not in ("zero", "repeatpad", "repeat"):
            raise ValueError(f"padding must be None (the checkpoint's own), True / 'zero' (zero padding, as "
                             f"processor(padding=True) does under transformers 4.x), 'repeatpad' or 'repeat'; got "
                             f"{padding!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = str(model_name_or_path)
        self.padding = padding
        self.__name__ = "clap"
        self._feature_extractor: Any = None
        self._tokenizer: Any = None

    def __repr__(self) -> str:
        return f"CLAPReward(model={self.model_name_or_path!r}, padding={self.padding!r})"

    def _load(self, device: Any, dtype: Any) -> Any:
        from transformers import AutoFeatureExtractor, AutoTokenizer, ClapModel

        self._feature_extractor = AutoFeatureExtractor.from_pretrained(self.model_name_or_path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_name_or_path)
        return ClapModel.from_pretrained(self.model_name_or_path, dtype=dtype).to(device)

    @property
    def sampling_rate(self) -> int:
        """The rate the checkpoint's feature extractor expects (48000 for the LAION checkpoints)."""
        self.load()
        return int(self._feature_extractor.sampling_rate)

    def prepare_audio(self, waveform: Any, rate: Any) -> Any:
        """One sample's waveform as the feature extractor takes it: mono, at the checkpoint's rate, float32."""
        if rate is None:
            raise ValueError("clap needs each sample's audio_sampling_rate (samples per second)")
        return resample_audio(to_mono(waveform), int(rate), self.sampling_rate)

    def features(self, prompts: Sequence[str], waveforms: Sequence[Any]) -> dict[str, Any]:
        """The model inputs of one chunk: the prompts tokenised (padded, truncated) and the prepared waveforms through
        the feature extractor with the chosen padding."""
        import numpy as np

        model = self.load()
        extra = {} if self.padding in (None, "zero") else {"padding": self.padding}
        waveforms = list(waveforms)
        if self.padding == "zero":
            length = int(self._feature_extractor.nb_max_samples)
            waveforms = [np.pad(w, (0, length - len(w))) if len(w) < length else w for w in waveforms]
        audio = self._feature_extractor(waveforms, sampling_rate=self.sampling_rate, return_tensors="pt", **extra)
        text = self._tokenizer(list(prompts), padding=True, truncation=True, return_tensors="pt")
        device = self.current_device
        dtype = next(model.parameters()).dtype
        inputs = {"input_ids": text["input_ids"], "attention_mask": text["attention_mask"],
                  "input_features": audio["input_features"].to(dtype)}
        if "is_longer" in audio:
            inputs["is_longer"] = audio["is_longer"]
        return {k: v.to(device) for k, v in inputs.items()}

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        prompts = list(prompts)
        if len(prompts) != len(images):
            raise ValueError(f"clap got {len(prompts)} prompts and {len(images)} samples")
        audio, rates = columns.get("audio"), columns.get("audio_sampling_rate")
        if audio is None or rates is None:
            raise ValueError("clap scores generated sound but the batch has no 'audio' / 'audio_sampling_rate' "
                             "columns: train a family that generates sound (LTX-2), or call "
                             "reward(prompts, samples, audio=[(channels, samples) arrays], audio_sampling_rate=[...])")
        audio, rates = list(audio), list(rates)
        if len(audio) != len(prompts) or len(rates) != len(prompts):
            raise ValueError(f"clap got {len(prompts)} prompts, {len(audio)} audio clips and {len(rates)} rates")
        if not prompts:
            return []
        return super().__call__(prompts, [None] * len(prompts), audio=audio, audio_sampling_rate=rates)

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        """Cosine of the normalised audio and text embeddings, one per pair, float32."""
        import torch

        model = self.load()
        waveforms = [self.prepare_audio(a, r) for a, r in zip(columns["audio"], columns["audio_sampling_rate"])]
        scores = []
        for sl in self.chunks(len(prompts)):
            outputs = model(**self.features(prompts[sl], waveforms[sl]))
            audio_embeds = torch.nn.functional.normalize(outputs.audio_embeds.float(), dim=-1)
            text_embeds = torch.nn.functional.normalize(outputs.text_embeds.float(), dim=-1)
            scores.append((audio_embeds * text_embeds).sum(dim=-1))
        return torch.cat(scores)
