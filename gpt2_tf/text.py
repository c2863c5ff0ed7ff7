"""Text in, text out: the encoder around the sampling loop, as the original sample scripts use it."""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Optional

import numpy as np

from .encoder import Encoder, get_encoder
from .runtime import Model
from .sample import sample_chunks
from .validate import GPT2Error, check_seed, default_length, is_int


def iter_samples(model: Model, prompt: Optional[str] = None, length: Optional[int] = None, *,
                 nsamples: Optional[int] = 1, batch_size: int = 1, encoder: Optional[Encoder] = None,
                 temperature=1, top_k=0, top_p=1, seed: Optional[int] = None, mode: Optional[str] = None,
                 chunk: Optional[int] = None, progress: Optional[Callable[[int], None]] = None,
                 logit_bias=None, presence_penalty=0, frequency_penalty=0, repetition_penalty=1) -> Iterator[str]:
    """Generated texts (the continuation only), batch_size at a time, as they are made.

    prompt None samples unconditionally after <|endoftext|>. nsamples None goes on
    until the caller stops; otherwise it must be a positive multiple of batch_size.
    seed is an integer: batch b samples with the pair (seed, b). progress, when
    given, is called with the number of new tokens after each compiled chunk of
    the loop. logit_bias and the penalties are sample_chunks' (gpt2_tf.penalties).
    encoder: by default the vocabulary of the folder load_model read (GPT-2's
    bundled one for a Model built otherwise). Every argument is checked before
    this returns.
    """
    encoder = encoder or (model.folder.encoder() if model.folder is not None else get_encoder())
    if not is_int(batch_size) or batch_size < 1:
        raise GPT2Error(f'batch_size must be a positive integer, got {batch_size!r}')
    if nsamples is not None and (not is_int(nsamples) or nsamples < 1 or nsamples % batch_size):
        raise GPT2Error(f'nsamples ({nsamples!r}) must be a positive multiple of batch_size ({batch_size}), '
                        'or None for no end')
    if seed is not None and not is_int(seed):
        raise GPT2Error(f'seed must be an integer here (batch b draws with the pair (seed, b)), got {seed!r}')
    if seed is not None:
        check_seed(seed, 1)
    if prompt is None:
        request = dict(start_token=encoder.end_of_text('unconditional samples start from', 'give a prompt'),
                       batch_size=batch_size)
    else:
        context = encoder.encode(prompt)
        if not context:
            raise GPT2Error('the prompt is empty: it encodes to no tokens; give some text, or None for unconditional')
        request = dict(context=context, batch_size=batch_size)
    if length is None:
        length = default_length(model.hparams.n_ctx, prompt is not None)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, mode=mode, chunk=chunk, logit_bias=logit_bias,
                   presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                   repetition_penalty=repetition_penalty, **request)

    def batch(b: int) -> Iterator:  # sample_chunks checks its arguments when called, before it runs
        return sample_chunks(model, length, seed=None if seed is None else (seed, b), **options)

    first = batch(0)
    batches = itertools.count(1) if nsamples is None else range(1, nsamples // batch_size)
    return _texts(itertools.chain([first], map(batch, batches)), encoder, progress)


def _texts(batches: Iterator[Iterator], encoder: Encoder, progress: Optional[Callable[[int], None]]) -> Iterator[str]:
    """Each batch's rows as texts, once its chunks are all drawn."""
    for chunks in batches:
        drawn = []
        for tokens in chunks:
            drawn.append(tokens)
            if progress is not None:
                progress(tokens.size)
        for row in np.concatenate(drawn, axis=1):
            yield encoder.decode(row)  # the new tokens alone


def generate(model: Model, prompt: Optional[str] = None, length: Optional[int] = None, **options) -> list:
    """Generated texts for a prompt (or unconditionally): one call from text to text.

    Takes the options of iter_samples: nsamples (a number: None, no end, is
    iter_samples' alone), batch_size, encoder, temperature, top_k, top_p, seed,
    mode, chunk, progress, logit_bias and the penalties.
    """
    if 'nsamples' in options and options['nsamples'] is None:
        raise GPT2Error('generate returns a list, so nsamples=None (no end) would never return: give a number, '
                        'or iterate over iter_samples')
    return list(iter_samples(model, prompt, length, **options))
