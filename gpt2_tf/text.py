"""Text in, text out: the encoder around sample_sequence, as the original sample scripts use it."""

from __future__ import annotations

import itertools
import os
from typing import Iterator, Optional

from .assets import bundled_checkpoint  # noqa: F401  (re-exported: the CLI's fallback model)
from .encoder import END_OF_TEXT, Encoder, get_encoder
from .model import Model
from .sample import sample_sequence


def encoder_for(model_dir: str | os.PathLike) -> Encoder:
    """The model folder's own encoder.json and vocab.bpe when it has them, else the bundled GPT-2 files."""
    if os.path.exists(os.path.join(model_dir, 'encoder.json')) or os.path.exists(os.path.join(model_dir, 'vocab.bpe')):
        return get_encoder(model_dir)
    return get_encoder()


def default_length(model: Model, conditional: bool) -> int:
    """The original scripts' defaults: half the window after a prompt, the whole window without one."""
    n_ctx = model.hparams.n_ctx
    return n_ctx // 2 if conditional else n_ctx


def iter_samples(model: Model, prompt: Optional[str] = None, length: Optional[int] = None, *,
                 nsamples: Optional[int] = 1, batch_size: int = 1, encoder: Optional[Encoder] = None,
                 temperature: float = 1, top_k: int = 0, top_p: float = 1, seed: Optional[int] = None,
                 mode: str = 'xla') -> Iterator[str]:
    """Yields generated texts (the continuation only), batch_size at a time.

    prompt None samples unconditionally after <|endoftext|>. nsamples None goes on
    until the caller stops; otherwise it must be a multiple of batch_size.
    """
    encoder = encoder or get_encoder()
    if batch_size < 1:
        raise ValueError(f'batch_size must be at least 1, got {batch_size}')
    if nsamples is not None and nsamples % batch_size:
        raise ValueError(f'nsamples ({nsamples}) must be a multiple of batch_size ({batch_size})')
    if prompt is None:
        request = dict(start_token=encoder.encoder[END_OF_TEXT], batch_size=batch_size)
        skip = 1
    else:
        context = encoder.encode(prompt)
        if not context:
            raise ValueError('the prompt is empty: it encodes to no tokens')
        request = dict(context=context, batch_size=batch_size)
        skip = len(context)
    if length is None:
        length = default_length(model, prompt is not None)
    batches = itertools.count() if nsamples is None else range(nsamples // batch_size)
    for batch in batches:
        tokens = sample_sequence(model, length, temperature=temperature, top_k=top_k, top_p=top_p,
                                 seed=None if seed is None else (seed, batch), mode=mode, **request)
        for row in tokens:
            yield encoder.decode(row[skip:])


def generate(model: Model, prompt: Optional[str] = None, length: Optional[int] = None, **options) -> list:
    """Generated texts for a prompt (or unconditionally): one call from text to text.

    Takes the options of iter_samples: nsamples, batch_size, encoder, temperature,
    top_k, top_p, seed, mode.
    """
    return list(iter_samples(model, prompt, length, **options))
