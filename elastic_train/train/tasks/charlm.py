"""A tiny character-level language model on a corpus the project generates itself (no downloads).

The corpus is made of sentences from a small seeded grammar (subject, verb, object, place, time), so it has
real structure to learn: the loss falls from about ln(vocabulary) towards the grammar's entropy within a few
hundred steps. Samples are fixed windows of ``context + 1`` characters; the model is a small causal
Transformer (no dropout, so training is deterministic).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from elastic_train.train.api import Task

_SUBJECTS = [
    "the cat",
    "a dog",
    "my friend",
    "the old man",
    "her sister",
    "a small bird",
    "the teacher",
    "we",
]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "remembers", "keeps"]
_OBJECTS = ["the red ball", "a long letter", "the green door", "an apple", "the river", "a quiet song"]
_PLACES = ["in the garden", "at the market", "near the station", "on the hill", "by the sea", "at home"]
_TIMES = ["today", "every morning", "at night", "in winter", "after lunch", "again"]


def make_corpus(n_sentences: int, corpus_seed: int) -> str:
    """A deterministic text of ``n_sentences`` grammatical sentences."""
    rng = random.Random(corpus_seed)
    sentences = []
    for _ in range(n_sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_PLACES))
        if rng.random() < 0.4:
            words.append(rng.choice(_TIMES))
        sentences.append(" ".join(words) + ".")
    return " ".join(sentences)


class CharWindows:
    """Windows of ``context + 1`` characters starting every ``stride`` characters of the encoded corpus."""

    def __init__(self, text: str, context: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocab)}
        self.tokens = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.context = context
        self.stride = stride
        self._offsets = torch.arange(context + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - self.context - 1) // self.stride + 1

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.stride
        return self.tokens[start : start + self.context + 1]

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        starts = torch.as_tensor(indices, dtype=torch.long) * self.stride
        return self.tokens[starts.unsqueeze(1) + self._offsets]


class CharTransformer(nn.Module):
    """Token + position embeddings, a few causal Transformer layers, a linear head."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def lm_loss_per_sample(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return losses.mean(dim=1)


def build(
    *,
    n_sentences: int = 3000,
    corpus_seed: int = 7,
    context: int = 32,
    stride: int = 8,
    width: int = 64,
    layers: int = 2,
    heads: int = 4,
    lr: float = 3e-3,
) -> Task:
    """The demo task: about 12k windows of 33 characters, a 2-layer width-64 Transformer, AdamW."""
    data = CharWindows(make_corpus(n_sentences, corpus_seed), context, stride)
    model = CharTransformer(len(data.vocab), context, width, layers, heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return Task(
        model=model, optimizer=optimizer, dataset=data, loss_fn=lm_loss_per_sample, batch_fn=data.batch
    )
