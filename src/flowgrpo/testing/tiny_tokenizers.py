"""Small tokenizers made locally and deterministically, for the tiny test pipelines.

* **CLIP** (byte-level BPE with the ``</w>`` end-of-word suffix, the format of ``openai/clip-vit-large-patch14``):
  the vocabulary holds all 256 byte symbols, alone and with ``</w>``, so any text encodes without unknown tokens;
  merges are learned here by plain byte-pair counting over :data:`PROMPT_CORPUS` (ties broken lexically), then
  ``<|startoftext|>`` and ``<|endoftext|>`` close the vocabulary, as in CLIP.
* **Qwen2** (byte-level BPE without an end-of-word suffix, Qwen2's pre-tokenisation pattern, the chat and vision
  special tokens of ``Qwen/Qwen2.5-VL-7B-Instruct``): merges learned by the same byte-pair counting, then extended
  so that every pre-token of the Qwen-Image / Qwen-Image-Edit system prompts is one token. Those pipelines drop a
  fixed number of leading hidden states (34, and 64 for the edit template): the system part of each template must
  tokenise to exactly that many tokens, as it does with the real tokenizer.
* **Qwen3** (FLUX.2 [klein], Z-Image): the Qwen2 tokenizer with ``<think>`` / ``</think>`` and a chat template that
  renders a conversation as Qwen3's does (``enable_thinking=False`` adds the empty thinking block).
* **Mistral** (FLUX.2 [dev]'s Mistral Small 3.1, whose Tekken tokenizer is a byte-level BPE too): the Qwen2
  vocabulary and merges with Mistral's special tokens (``<s>``, ``[INST]``, ``[SYSTEM_PROMPT]``, the Pixtral image
  tokens ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``) and a chat template in Mistral's layout.
* **T5** (SentencePiece unigram with ``nmt_nfkc`` normalisation, ``<pad>``=0, ``</s>``=1, ``<unk>``=2, 100 sentinel
  ``<extra_id_*>`` tokens, as in ``google/t5-v1_1-*``): trained single-threaded by the ``sentencepiece`` library on
  the same corpus, with every printable ASCII character and the common typographic quotes and dashes required.

Both builders depend on nothing but the corpus, so two builds give identical files.
"""

from __future__ import annotations

import functools
import io
import itertools
import string
import tempfile
import unicodedata
from collections import Counter
from pathlib import Path

import regex
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

__all__ = [
    "PROMPT_CORPUS",
    "CLIP_MODEL_MAX_LENGTH",
    "T5_MODEL_MAX_LENGTH",
    "MISTRAL_CHAT_TEMPLATE",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN_SPECIAL_TOKENS",
    "QWEN_TEMPLATE_PREFIXES",
    "build_clip_tokenizer",
    "build_qwen2_tokenizer",
    "build_mistral_tokenizer",
    "build_qwen3_tokenizer",
    "build_t5_tokenizer",
    "clip_vocab_and_merges",
    "qwen2_vocab_and_merges",
    "t5_sentencepiece_model",
]

CLIP_MODEL_MAX_LENGTH = 77
T5_MODEL_MAX_LENGTH = 512
CLIP_NUM_MERGES = 1200
T5_VOCAB_SIZE = 1000

_HANDWRITTEN_PROMPTS = """\
a photo of a cat sitting on a wooden table
a watercolor painting of a lighthouse at sunset, soft light, high detail
an astronaut riding a horse on the moon, digital art
a red apple next to a green pear on a white plate
two dogs playing in the snow; one is brown and the other is black
a sign that says "OPEN 24 HOURS" in neon letters
a chalkboard with the words 'Happy Birthday!' written on it
a storefront with the text “Bakery & Café” painted above the door
a poster reading "SALE: 50% OFF" in bold red type
a street sign that reads ‘Main St.’ at a busy intersection
a T-shirt printed with the slogan "I <3 NY"
a book cover titled "The Art of Flow (2nd Edition)"
a coffee mug that says 'Don't talk to me before coffee'
a cake with "Happy 30th, Anna!" written in icing
a banner: "Welcome to the 2024 Science Fair" hanging in a gym
a license plate reading ABC-1234
a price tag showing $19.99 on a pair of shoes
a clock showing 10:45 on a brick wall
a scoreboard displaying 3 - 2 at the end of the match
the equation e = mc^2 written on a whiteboard
an email address like hello@example.com on a business card
a hashtag #sunset printed on a postcard
a road sign: speed limit 60 km/h
a recipe card listing 2 cups of flour, 1/2 tsp salt and 3 eggs
a neon sign that says “Let’s dance…”
a menu board: soup $4, salad $6, sandwich $8
three blue circles and one yellow triangle on a gray background
a small green square above a large purple star
four orange hexagons arranged in a row
a pink heart to the left of a cyan diamond
one black circle, two white squares, and five red triangles
a cozy cabin in the woods, oil painting, warm colors
a futuristic city skyline at night with flying cars
a close-up portrait of an old man with a gray beard, 85mm, f/1.8
a bowl of ramen with chopsticks, studio lighting
a field of sunflowers under a bright blue sky
a cute robot holding an umbrella in the rain
a panda eating bamboo, national geographic style
an isometric 3D render of a tiny island with palm trees
a minimalist logo of a mountain and a river
a medieval castle on a hill surrounded by fog
a vintage car parked in front of a diner, 1950s style
a bouquet of roses in a glass vase on a windowsill
a steaming cup of tea next to an open book
a koala wearing sunglasses, cartoon style
a train crossing a stone bridge over a canyon
a child flying a kite on the beach at noon
a snowy mountain reflected in a calm lake at dawn
a pixel art sprite of a knight with a sword and shield
an underwater scene with colorful coral and tropical fish
a bicycle leaning against a yellow wall
a plate of pancakes with maple syrup and blueberries
a crowded market in Marrakesh, vibrant, detailed
the Eiffel Tower at night with sparkling lights
a hand-drawn map of a fantasy kingdom
a golden retriever puppy chasing a tennis ball
a glass of orange juice on a sunny kitchen counter
an owl perched on a branch under a full moon
a spaceship landing on a red desert planet
a cat and a dog sleeping together on a couch
a violin resting on sheet music
a fox in an autumn forest, leaves falling
a jar of honey with a wooden dipper
a foggy street in London with red buses
a sailboat on a stormy sea, dramatic clouds
a farmer's market with fresh vegetables and fruit
a portrait of a woman with curly hair, renaissance painting
a steam locomotive in the Swiss Alps
a bowl of fruit: apples, bananas, grapes and oranges
a neon-lit alley in Tokyo after the rain
an abstract painting with bold geometric shapes
a lion resting in tall grass at golden hour
a tiny mouse reading a newspaper
a hot air balloon over a patchwork of fields
a library with tall shelves and a rolling ladder
a penguin wearing a scarf and a knitted hat
a waterfall in a tropical jungle
a pizza with pepperoni, olives and mushrooms
a teddy bear sitting on a rocking chair
a wind turbine farm on green hills
a skateboarder doing a trick at a skate park
it's a sunny day; isn't it lovely? yes, it is!
we'll meet at the park, they're late, you've seen it, I'm here, he'd go
quotes: "double", 'single', “curly double”, ‘curly single’, and «guillemets»
dashes – and — and hyphen-ated words, ellipsis… and dots...
numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14 1,000,000 50% #1 No. 7
symbols: ~ ` ! @ # $ % ^ & * ( ) _ + - = { } [ ] | \\ : ; " ' < > , . ? /
accents: café, naïve, résumé, jalapeño, über, façade, São Paulo, Zürich
"""

_COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "pink", "cyan", "gray", "brown"]
_SHAPES = ["circle", "square", "triangle", "star", "heart", "hexagon", "diamond", "rectangle", "cross", "ring"]
_RELATIONS = ["above", "below", "to the left of", "to the right of", "next to", "inside", "behind", "on top of"]
_COUNTS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_STYLES = ["photo", "painting", "sketch", "3D render", "illustration", "poster", "cartoon", "watercolor"]


def _generated_prompts() -> list[str]:
    prompts = []
    for i, (color, shape) in enumerate(itertools.product(_COLORS, _SHAPES)):
        other_color = _COLORS[(i * 5 + 3) % len(_COLORS)]
        other_shape = _SHAPES[(i * 7 + 1) % len(_SHAPES)]
        relation = _RELATIONS[i % len(_RELATIONS)]
        count = _COUNTS[i % len(_COUNTS)]
        style = _STYLES[i % len(_STYLES)]
        plural = shape + ("es" if shape.endswith(("s", "x", "ch", "sh")) else "s")
        prompts.append(f"a {color} {shape} {relation} a {other_color} {other_shape}")
        prompts.append(f"a {style} of {count} {color} {plural}, {i + 2} in total")
    return prompts


PROMPT_CORPUS: tuple[str, ...] = tuple(_HANDWRITTEN_PROMPTS.splitlines()) + tuple(_generated_prompts())
"""The embedded training text of both tokenizers: image prompts with quotes, digits and punctuation."""

# --------------------------------------------------------------------------------------------------------------------
# CLIP: byte-level BPE
# --------------------------------------------------------------------------------------------------------------------

# CLIP's pre-tokenisation pattern (the one `transformers.CLIPTokenizer` applies after lower-casing).
_CLIP_WORD_PATTERN = regex.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)
_END_OF_WORD = "</w>"


def _byte_table() -> dict[int, str]:
    """The 256 printable stand-ins for bytes used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the others (controls, space, ...) are shifted past U+0100 so that
    every byte becomes one visible, non-whitespace character. Ordered as CLIP's vocabulary lists them.
    """
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table = {b: chr(b) for b in kept}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _clip_words(lines: tuple[str, ...]) -> Counter[tuple[str, ...]]:
    """Count pre-tokenised words as tuples of byte symbols, the last one carrying ``</w>``."""
    table = _byte_table()
    counts: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        text = regex.sub(r"\s+", " ", line).strip().lower()
        for word in _CLIP_WORD_PATTERN.findall(text):
            symbols = [table[b] for b in word.encode("utf-8")]
            symbols[-1] += _END_OF_WORD
            counts[tuple(symbols)] += 1
    return counts


def _merge_pair(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _learn_merges(words: Counter[tuple[str, ...]], num_merges: int) -> list[tuple[str, str]]:
    """Byte-pair merges learned from ``words`` (symbol tuples with their counts): up to ``num_merges`` times, merge
    the most frequent adjacent pair (ties: the smallest pair), stopping when no pair occurs at least twice."""
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break
        best, best_count = min(pair_counts.items(), key=lambda item: (-item[1], item[0]))
        if best_count < 2:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            merged[_merge_pair(word, best) if best[0] in word else word] += count
        words = merged
    return merges


@functools.lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], tuple[str, ...]]:
    """Learn the CLIP BPE vocabulary and merge list from :data:`PROMPT_CORPUS` (cached, deterministic).

    Each round merges the most frequent adjacent pair (ties: the lexically smallest pair) until
    ``CLIP_NUM_MERGES`` merges are made or no pair occurs twice.
    """
    merges = _learn_merges(_clip_words(PROMPT_CORPUS), CLIP_NUM_MERGES)

    byte_symbols = list(_byte_table().values())
    tokens = byte_symbols + [s + _END_OF_WORD for s in byte_symbols]
    seen = set(tokens)
    for left, right in merges:
        token = left + right
        if token not in seen:
            tokens.append(token)
            seen.add(token)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    return vocab, tuple(f"{left} {right}" for left, right in merges)


def build_clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """A CLIP tokenizer over the locally learned vocabulary (``model_max_length`` 77, as in CLIP).

    ``pad_token="!"`` mirrors the second (OpenCLIP bigG) tokenizer of Stable Diffusion 3.
    """
    vocab, merges = clip_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=[tuple(m.split(" ")) for m in merges], pad_token=pad_token,
                         model_max_length=CLIP_MODEL_MAX_LENGTH)


# --------------------------------------------------------------------------------------------------------------------
# T5: SentencePiece unigram
# --------------------------------------------------------------------------------------------------------------------

_T5_REQUIRED_CHARS = string.ascii_letters + string.digits + string.punctuation + "“”‘’«»–—…°€£éèêëàâäïîôöüûçñßø"


@functools.lru_cache(maxsize=1)
def t5_sentencepiece_model() -> bytes:
    """Train the T5 unigram SentencePiece model on :data:`PROMPT_CORPUS`; returns the serialized model.

    Trained from an in-memory iterator on one thread, so the bytes hold no file paths and repeat exactly.
    """
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(PROMPT_CORPUS),
        model_writer=buffer,
        model_type="unigram",
        vocab_size=T5_VOCAB_SIZE,
        hard_vocab_limit=False,
        character_coverage=1.0,
        required_chars=_T5_REQUIRED_CHARS,
        normalization_rule_name="nmt_nfkc",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buffer.getvalue()


def build_t5_tokenizer() -> T5Tokenizer:
    """A T5 tokenizer over the locally trained unigram model (``model_max_length`` 512, 100 sentinel tokens)."""
    with tempfile.TemporaryDirectory(prefix="flowgrpo-t5-spm-") as tmp:
        model_file = Path(tmp) / "spiece.model"
        model_file.write_bytes(t5_sentencepiece_model())
        tokenizer = T5Tokenizer.from_pretrained(tmp, model_max_length=T5_MODEL_MAX_LENGTH, legacy=False)
    return tokenizer


# --------------------------------------------------------------------------------------------------------------------
# Qwen2: byte-level BPE with chat and vision special tokens
# --------------------------------------------------------------------------------------------------------------------

QWEN_NUM_MERGES = 600

#: Special tokens in the order (and so with the relative ids) of the Qwen2.5-VL tokenizer.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)

#: The system part of the Qwen-Image (text-to-image) and Qwen-Image-Edit prompt templates of diffusers, and the
#: number of tokens each must have (the pipelines' ``prompt_template_encode_start_idx``).
QWEN_TEMPLATE_PREFIXES: dict[str, tuple[str, int]] = {
    "qwenimage": (
        "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
        "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
        34,
    ),
    "qwenimage_edit": (
        "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
        "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
        "image that meets the user's requirements while maintaining consistency with the original input where "
        "appropriate.<|im_end|>\n<|im_start|>user\n",
        64,
    ),
}

# Qwen2's pre-tokenisation pattern (``transformers.Qwen2Tokenizer``).
_QWEN_WORD_PATTERN = regex.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN_SPECIAL_PATTERN = regex.compile("|".join(regex.escape(t) for t in QWEN_SPECIAL_TOKENS))


def _qwen_words(text: str) -> list[tuple[str, ...]]:
    """Pre-tokenised words of ``text`` (special tokens removed) as tuples of byte symbols."""
    table = _byte_table()
    words = []
    for chunk in _QWEN_SPECIAL_PATTERN.split(unicodedata.normalize("NFC", text)):
        for word in _QWEN_WORD_PATTERN.findall(chunk):
            words.append(tuple(table[b] for b in word.encode("utf-8")))
    return words


def _apply_bpe(word: tuple[str, ...], ranks: dict[tuple[str, str], int]) -> tuple[str, ...]:
    """Byte-pair encoding of one word: repeatedly merge the adjacent pair of lowest rank (as ``tokenizers`` does)."""
    while len(word) > 1:
        best = min(((ranks.get(pair, len(ranks) + 1), i) for i, pair in enumerate(zip(word, word[1:]))))
        if best[0] > len(ranks):
            break
        word = _merge_pair(word, (word[best[1]], word[best[1] + 1]))
    return word


@functools.lru_cache(maxsize=1)
def qwen2_vocab_and_merges() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Learn the Qwen2 byte-level BPE from :data:`PROMPT_CORPUS`, then complete every template word (cached).

    ``QWEN_NUM_MERGES`` merges are learned by frequency (ties: the lexically smallest pair). Then, for each word of
    the template prefixes in :data:`QWEN_TEMPLATE_PREFIXES`, merges are appended (each one joining the first two
    pieces the word still has) until the word encodes to a single token, so each prefix has exactly one token per
    pre-token. Special tokens are not part of the vocabulary returned here (they are added tokens).
    """
    counts: Counter[tuple[str, ...]] = Counter()
    for line in PROMPT_CORPUS:
        counts.update(_qwen_words(line))
    merges = _learn_merges(counts, QWEN_NUM_MERGES)

    ranks = {pair: i for i, pair in enumerate(merges)}
    template_words = [w for prefix, _ in QWEN_TEMPLATE_PREFIXES.values() for w in _qwen_words(prefix)]
    for word in template_words + _qwen_words("assistant"):
        pieces = _apply_bpe(word, ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            pieces = _apply_bpe(word, ranks)

    tokens = list(_byte_table().values())
    seen = set(tokens)
    for left, right in merges:
        if left + right not in seen:
            tokens.append(left + right)
            seen.add(left + right)
    return {token: i for i, token in enumerate(tokens)}, tuple(merges)


def build_qwen2_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer over the locally learned vocabulary, with the Qwen2.5-VL special tokens.

    ``<|endoftext|>`` is the padding (and end-of-text) token, as in Qwen2.5-VL; ``model_max_length`` is 32768.
    """
    from tokenizers import AddedToken

    vocab, merges = qwen2_vocab_and_merges()
    vocab = dict(vocab)
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(merges), model_max_length=32768)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS],
                         special_tokens=True)
    return tokenizer


#: Qwen3's chat template, reduced to what the FLUX.2 [klein] and Z-Image pipelines render: text messages, the
#: generation prompt, and the empty thinking block that ``enable_thinking=False`` appends.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def build_qwen3_tokenizer() -> Qwen2Tokenizer:
    """The Qwen2 tokenizer of :func:`build_qwen2_tokenizer` as Qwen3 uses it: ``<think>`` and ``</think>`` added
    (not special, as in Qwen3) and :data:`QWEN3_CHAT_TEMPLATE`."""
    from tokenizers import AddedToken

    tokenizer = build_qwen2_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


#: Mistral Small 3.1's chat layout for text (and image placeholder) messages, as FLUX.2 [dev] renders them.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set ns = namespace(text='') -%}"
    "{%- if message['content'] is string -%}{%- set ns.text = message['content'] -%}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set ns.text = ns.text + part['text'] -%}"
    "{%- else -%}{%- set ns.text = ns.text + '[IMG]' -%}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + ns.text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST]' + ns.text + '[/INST]' }}"
    "{%- else -%}{{ ns.text + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)

#: Mistral's special tokens (control tokens first, as in its vocabulary).
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def build_mistral_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer with Mistral's special tokens and :data:`MISTRAL_CHAT_TEMPLATE` (see the module
    docstring): ``<s>`` begins a conversation, ``<pad>`` pads."""
    from tokenizers import AddedToken

    vocab, merges = qwen2_vocab_and_merges()
    vocab = dict(vocab)
    for token in MISTRAL_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(merges), model_max_length=131072, unk_token="<unk>",
                               bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIAL_TOKENS],
                         special_tokens=True)
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer
