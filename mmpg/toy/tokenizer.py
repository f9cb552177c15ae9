"""A small byte-level BPE tokenizer trained here, shaped like Qwen's.

Tests and the demo need no downloaded checkpoint: they use a tokenizer trained locally on a
deterministic text corpus (grounding questions, answers, numbers, chat words). It uses the same pre-tokenizer regex and
byte-level alphabet as `transformers.Qwen2Tokenizer`, carries the Qwen special tokens and our own Qwen-format chat
template, and is wrapped in `Qwen2Tokenizer` so `AutoProcessor.from_pretrained` loads it exactly as a real one.
"""

from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

# Order matters: ids follow the trained vocabulary in this order, like Qwen's added tokens.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Ordinary (non-special) added tokens: reasoning tags stay visible in decoded text.
QWEN_ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

# Same split as transformers' Qwen2Tokenizer, so trained merges behave like Qwen's.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen chat format, written for mmpg. Messages may hold a string or a list of {"type": "text"|"image"|"video"} parts.
_SYSTEM_BLOCK = (
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n__SYSTEM__<|im_end|>\n{% endif %}"
)
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "__SYSTEM_BLOCK__"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_template(default_system: str | None) -> str:
    """The Jinja chat template. Qwen2.5-VL adds `default_system` when a conversation has no system turn; Qwen3-VL
    adds none (pass None)."""
    block = _SYSTEM_BLOCK.replace("__SYSTEM__", default_system) if default_system else ""
    return _CHAT_TEMPLATE.replace("__SYSTEM_BLOCK__", block)


_COLOURS = "red green blue yellow orange purple pink white black cyan magenta brown grey".split()
_SHAPES = "circle square triangle star ball box person dog car door cup book phone".split()
_VERBS = "appears moves disappears opens closes walks turns changes jumps sits stands holds picks puts".split()
_WORDS = (
    "the a an of to in on at from and then video moment when where what which who is are was were it this that "
    "second seconds start end time answer think reasoning query sentence describe find locate event happens "
    "left right top bottom center slowly quickly after before during until while first last into out up down "
    "Please watch carefully. The video lasts about Give the start and end times in seconds. Output your "
    "reasoning process within and the final answer in the format: You are a helpful assistant. system user "
    "assistant frames shows person opens the door takes a cup of coffee puts it on the table"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    """A deterministic mixed corpus: prose, numbers with decimals, times, tagged answers and chat turns."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        colour, shape, verb = rng.choice(_COLOURS), rng.choice(_SHAPES), rng.choice(_VERBS)
        s = round(rng.uniform(0, 300), rng.choice([0, 1, 2]))
        e = round(s + rng.uniform(0.5, 60), rng.choice([0, 1, 2]))
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        kind = i % 4
        if kind == 0:
            lines.append(f"A {colour} {shape} {verb} {words}.")
        elif kind == 1:
            lines.append(f"<think>The {colour} {shape} {verb} near {s} seconds.</think> <answer>{s} to {e}</answer>")
        elif kind == 2:
            lines.append(f"<|im_start|>user\n{words} {s:.1f} - {e:.1f} {int(s) // 60:02d}:{int(s) % 60:02d}<|im_end|>")
        else:
            lines.append(f"The video lasts {e:.2f} seconds. {words} {rng.randint(0, 100000)}")
    return lines


def train_bpe(vocab_size: int = 2048, seed: int = 0, n_lines: int = 6000) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train byte-level BPE on the corpus; returns (vocab, merges) for `Qwen2Tokenizer`. Deterministic for a seed."""
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS) - len(QWEN_ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(n_lines, seed), trainer=trainer)
    vocab = tok.get_vocab()
    # tokenizers has no public merges getter; its JSON carries them as [left, right] pairs.
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return dict(sorted(vocab.items(), key=lambda kv: kv[1])), merges


def build_tokenizer(vocab_size: int = 2048, seed: int = 0, default_system: str | None = None):
    """A `Qwen2Tokenizer` with Qwen's special tokens, `<|im_end|>` as eos and `<|endoftext|>` as pad."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, merges = train_bpe(vocab_size, seed)
    # Special and added tokens take the ids right after the trained vocabulary, in Qwen's order.
    for token in QWEN_SPECIAL_TOKENS + QWEN_ADDED_TOKENS:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        chat_template=chat_template(default_system),
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED_TOKENS])
    tokenizer.padding_side = "left"
    return tokenizer
