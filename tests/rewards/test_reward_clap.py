"""`clap` on a tiny random ``ClapModel`` saved with ``laion/larger_clap_general``'s feature-extractor settings
(`flowgrpo.testing.tiny_clap`): the reward equals ``ClapModel`` called directly with the checkpoint's processor
settings, its ``padding=True`` option reproduces the peers' zero padding (and changes the score), sound is downmixed
and resampled with ``scipy.signal.resample_poly``, and the trainer's audio columns reach it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.rewards import accepts_audio, accepts_video, get_reward, resolve_reward_funcs
from flowgrpo.rewards.clap import CLAPReward, resample_audio, to_mono
from flowgrpo.testing.tiny_clap import LARGER_CLAP_GENERAL_FEATURES, save_tiny_clap

PROMPTS = ["a dog barking in the rain", "soft piano music", "a crowd cheering"]


@pytest.fixture(scope="module")
def clap_path(tmp_path_factory):
    return save_tiny_clap(tmp_path_factory.mktemp("clap"))


def _clips(rate, seconds=(1.7, 2.5, 0.8), channels=2, seed=0):
    rng = np.random.default_rng(seed)
    t = [np.arange(int(rate * s)) / rate for s in seconds]
    return [np.stack([np.sin(2 * np.pi * (220 + 200 * i) * ti) * 0.3 + 0.05 * rng.standard_normal(len(ti))
                      for _ in range(channels)]).astype(np.float32) for i, ti in enumerate(t)]


def _direct(path, prompts, mono_48k, pad_zero=False):
    """``ClapModel`` called directly: the checkpoint's own feature extractor (its padding and truncation) and
    tokenizer, the cosine of the normalised embeddings."""
    from transformers import ClapFeatureExtractor, ClapModel, RobertaTokenizer

    fe = ClapFeatureExtractor.from_pretrained(path)
    assert (fe.padding, fe.truncation, fe.sampling_rate) == ("repeatpad", "rand_trunc", 48000)
    if pad_zero:  # what processor(..., padding=True) does under transformers 4.x: no repeat, zeros to 10 s
        mono_48k = [np.pad(w, (0, fe.nb_max_samples - len(w))) for w in mono_48k]
    audio = fe(mono_48k, sampling_rate=48000, return_tensors="pt")
    text = RobertaTokenizer.from_pretrained(path)(prompts, padding=True, truncation=True, return_tensors="pt")
    model = ClapModel.from_pretrained(path).eval()
    with torch.no_grad():
        a = model.get_audio_features(input_features=audio["input_features"], is_longer=audio["is_longer"])
        t = model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
    a = getattr(a, "pooler_output", a)
    t = getattr(t, "pooler_output", t)
    return torch.nn.functional.cosine_similarity(a, t, dim=-1).tolist()


def test_reward_is_the_direct_clap_cosine_with_the_checkpoint_settings(clap_path):
    reward = get_reward("clap", model_name_or_path=str(clap_path), device="cpu")
    assert isinstance(reward, CLAPReward) and accepts_audio(reward) and accepts_video(reward)
    clips = _clips(48000)
    scores = reward(PROMPTS, [None] * 3, audio=clips, audio_sampling_rate=[48000] * 3)
    expected = _direct(clap_path, PROMPTS, [c.mean(axis=0) for c in clips])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert all(-1.0 <= s <= 1.0 for s in scores) and max(scores) - min(scores) > 1e-4

    # the peers' padding=True: zero padding instead of repeatpad, a different score for clips under 10 s
    zero = get_reward("clap", model_name_or_path=str(clap_path), device="cpu", padding=True)
    zero_scores = zero(PROMPTS, [None] * 3, audio=clips, audio_sampling_rate=[48000] * 3)
    assert zero_scores == pytest.approx(_direct(clap_path, PROMPTS, [c.mean(axis=0) for c in clips], pad_zero=True),
                                        abs=1e-5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(zero_scores, scores))
    assert LARGER_CLAP_GENERAL_FEATURES["padding"] == "repeatpad"


def test_downmix_and_polyphase_resampling(clap_path):
    from scipy.signal import resample_poly

    stereo = _clips(24000, seconds=(0.5,))[0]
    mono = to_mono(stereo)
    assert mono.shape == (12000,) and np.allclose(mono, stereo.mean(axis=0), atol=1e-7)
    up = resample_audio(mono, 24000, 48000)
    assert up.dtype == np.float32 and up.shape == (24000,)
    assert np.allclose(up, resample_poly(mono.astype(np.float64), 2, 1), atol=1e-6)
    assert resample_audio(mono, 44100, 48000).shape == (int(np.ceil(12000 * 160 / 147)),)  # 160/147 after the gcd
    assert resample_audio(mono, 48000, 48000) is not None

    reward = get_reward("clap", model_name_or_path=str(clap_path), device="cpu")
    clips = _clips(24000)
    scores = reward(PROMPTS, [None] * 3, audio=clips, audio_sampling_rate=[24000] * 3)
    expected = _direct(clap_path, PROMPTS, [resample_poly(c.mean(axis=0).astype(np.float64), 2, 1).astype(np.float32)
                                            for c in clips])
    assert scores == pytest.approx(expected, abs=1e-5)


def test_audio_columns_reach_clap_through_a_reward_set_and_bad_input_is_named(clap_path):
    rewards = resolve_reward_funcs(["clap", "jpeg_compressibility"], reward_weights=[0.5, 0.5],
                                   reward_kwargs={"clap": {"model_name_or_path": str(clap_path), "device": "cpu"}})
    assert rewards.audio_rewards == ["clap"]
    from PIL import Image

    videos = [[Image.new("RGB", (16, 16), c)] * 2 for c in ("red", "blue", "green")]
    clips = _clips(24000)
    result = rewards(PROMPTS, videos, audio=clips, audio_sampling_rate=[24000] * 3)
    direct = get_reward("clap", model_name_or_path=str(clap_path), device="cpu")(
        PROMPTS, videos, audio=clips, audio_sampling_rate=[24000] * 3)
    assert result.per_reward["clap"] == pytest.approx(direct, abs=1e-6)

    reward = get_reward("clap", model_name_or_path=str(clap_path), device="cpu")
    with pytest.raises(ValueError, match="audio"):
        reward(PROMPTS, [None] * 3)
    with pytest.raises(ValueError, match="audio_sampling_rate"):
        reward(PROMPTS[:1], [None], audio=clips[:1], audio_sampling_rate=[None])
    with pytest.raises(ValueError, match="padding"):
        CLAPReward(padding="mirror")
    with pytest.raises(ValueError, match="shape"):
        to_mono(np.zeros((1, 2, 3)))


def test_clap_behind_the_reward_server(clap_path):
    from flowgrpo.rewards.server import serve

    kwargs = {"clap": {"model_name_or_path": str(clap_path), "device": "cpu"}}
    clips = _clips(24000, seconds=(0.6, 0.9))
    direct = get_reward("clap", **kwargs["clap"])(PROMPTS[:2], [None] * 2, audio=clips,
                                                   audio_sampling_rate=[24000] * 2)
    with serve(["clap"], reward_kwargs=kwargs, port=0, token="") as server:
        from PIL import Image

        client = get_reward("remote", url=server.url, reward_name="clap", token_env=None, accepts_audio=True)
        assert accepts_audio(client)
        rewards = resolve_reward_funcs([client], reward_weights=[1.0])
        images = [Image.new("RGB", (8, 8))] * 2
        remote = rewards(PROMPTS[:2], images, audio=clips, audio_sampling_rate=[24000] * 2).per_reward
    assert list(remote.values())[0] == pytest.approx(direct, abs=1e-6)  # float32 audio survives JSON exactly
