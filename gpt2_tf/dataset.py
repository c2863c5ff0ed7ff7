"""Fine-tuning's data, as gpt-2-simple reads it: token chunks from text or an .npz, and random windows.

load_dataset turns a text file, a folder or glob of files, or an .npz of token
arrays into int32 chunks; Sampler draws training windows of n_ctx tokens, each
inside one chunk, reproducibly from a seed; encode_dataset writes the .npz.
"""

from __future__ import annotations

import bisect
import glob
import os
from typing import Callable, Optional

import numpy as np

from . import validate
from .encoder import END_OF_TEXT, Encoder
from .validate import GPT2Error


def _files(path: str) -> list:
    if os.path.isdir(path):
        return sorted(p for p in glob.glob(os.path.join(glob.escape(path), '**', '*'), recursive=True)
                      if os.path.isfile(p) and not os.path.basename(p).startswith('.'))
    if os.path.isfile(path):
        return [path]
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def _documents(file: str) -> list:
    """A text file's documents: split at lines that are exactly <|endoftext|>, blank ones dropped."""
    try:
        with open(file, encoding='utf-8') as f:
            text = f.read()
    except UnicodeDecodeError:
        raise GPT2Error(f'{file}: not UTF-8 text; datasets are text files or an .npz of tokens') from None
    documents = [d.strip('\n') for d in text.split(f'\n{END_OF_TEXT}\n')]
    return [d for d in documents if d.strip()]


def _encode_texts(files: list, encoder: Encoder, combine: int, progress: Optional[Callable]) -> list:
    """Documents gathered into chunks of at least `combine` characters, each document followed by 50256."""
    end = encoder.encoder[END_OF_TEXT]
    chunks, pending, size = [], [], 0

    def flush():
        ids = []
        for document in pending:
            ids.extend(encoder.encode(document))
            ids.append(end)
        chunks.append(np.asarray(ids, np.int32))

    for file in files:
        for document in _documents(file):
            pending.append(document)
            size += len(document)
            if size >= combine:
                flush()
                pending, size = [], 0
        if progress:
            progress(1)
    if pending:
        flush()
    return chunks


def load_dataset(path: str, encoder: Encoder, combine: int = 50000, *, progress: Optional[Callable] = None) -> list:
    """Token chunks (int32 arrays) from a text file, a folder or glob of files, or an .npz of token arrays.

    An .npz (gpt-2-simple's encode_dataset output) loads as is. Text files are
    split into documents at lines that are exactly <|endoftext|>, and every
    document is followed by the end-of-text token 50256, as GPT-2 was trained
    (gpt-2-simple instead encoded that line as seven ordinary tokens).
    Documents are gathered into chunks of at least `combine` characters before
    encoding, as gpt-2-simple does; training windows never cross chunks.
    """
    path = os.fspath(path)
    files = _files(path)
    if not files:
        raise FileNotFoundError(f'no dataset at {path}: give a text file, a folder, a glob, or an .npz')
    if len(files) == 1 and files[0].endswith('.npz'):
        with np.load(files[0]) as npz:
            chunks = [np.asarray(npz[name]) for name in npz.files]
    else:
        chunks = _encode_texts(files, encoder, combine, progress)
    chunks = [c for c in chunks if c.size]
    if not chunks:
        raise GPT2Error(f'the dataset at {path} is empty: no tokens in it')
    for chunk in chunks:
        validate.token_array(chunk, name='dataset tokens')
        validate.check_token_ids(chunk, encoder.n_vocab, name='dataset token')
    return [c.astype(np.int32) for c in chunks]


def encode_dataset(path: str, out_path: str, encoder: Encoder, combine: int = 50000) -> int:
    """Encodes a text dataset to an .npz of token chunks (gpt-2-simple's format); returns the token count."""
    chunks = load_dataset(path, encoder, combine)
    np.savez_compressed(out_path, *chunks)
    return int(sum(c.size for c in chunks))


class Sampler:
    """Random training windows of exactly `length` tokens, within one chunk each, reproducible from a seed."""

    def __init__(self, chunks: list, length: int, seed: Optional[int] = None):
        self.chunks = [c for c in chunks if len(c) >= length]
        if not self.chunks:
            longest = max(len(c) for c in chunks)
            raise GPT2Error(f'the dataset is shorter than one training window: its longest chunk has {longest} '
                            f'tokens, and a window is n_ctx = {length}; give more text')
        self.length = length
        # A window starts at any of the len - length + 1 offsets of a chunk, each equally likely.
        self.starts = np.cumsum([len(c) - length + 1 for c in self.chunks])
        self.rng = np.random.default_rng(seed)

    def sample(self, batch: int) -> np.ndarray:  # -> int32 [batch, length]
        rows = []
        for pick in self.rng.integers(0, self.starts[-1], size=batch):
            i = bisect.bisect_right(self.starts, pick)
            offset = pick - (self.starts[i - 1] if i else 0)
            rows.append(self.chunks[i][offset:offset + self.length])
        return np.stack(rows)
