"""Fine-tuning's data: a token file read in place, or gpt-2-simple's token chunks from text or an .npz.

A token file (a .bin that corpus.encode_corpus wrote, or nanoGPT's uint16
train.bin) is never loaded: token_windows draws windows of n_ctx tokens
through its memory map (corpus.Windows), optionally holding out its last
documents for validation, after checking it against the model's vocabulary.
Anything else goes through gpt-2-simple's path: load_dataset turns a text
file, a folder or glob of files, or an .npz of token arrays into int32 chunks
in memory, and Sampler draws windows inside one chunk each. Both samplers are
reproducible from a seed. encode writes either kind of file (encode_dataset:
the .npz).
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Callable, Optional

import numpy as np

from . import corpus, validate
from .encoder import END_OF_TEXT_ID, Encoder, encoder_for, get_encoder, vocabulary_files
from .train_config import COMBINE, check_integer
from .validate import GPT2Error, first_line, replacing

TOKEN_FILE = '.bin'


def _files(path: str, pattern: Optional[str] = None) -> list:
    """A dataset's files: a file; a folder's files (recursively; those matching pattern, when given, else
    every one not hidden); or a glob's."""
    if os.path.isdir(path) and pattern:
        return corpus.documents([path], glob=pattern)  # as a token file's encoding finds them
    if os.path.isdir(path):
        found = glob.glob(os.path.join(glob.escape(path), '**', '*'), recursive=True)
        return sorted(p for p in found if os.path.isfile(p) and not os.path.basename(p).startswith('.'))
    if os.path.isfile(path):
        return [path]
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def _documents(file: str) -> list:
    """A text file's documents as a token file's encoding reads them (corpus.file_pieces): its parts between
    lines that are exactly <|endoftext|>, without line breaks at their ends, empty ones left out (a .csv: each
    row's first column, after <|startoftext|>)."""
    documents, parts = [], []
    for piece in corpus.file_pieces(file):
        if piece is None:
            documents.append(''.join(parts))
            parts = []
        else:
            parts.append(piece)
    return documents


def _encode_texts(files: list, encoder: Encoder, combine: int, progress: Optional[Callable]) -> list:
    """Documents gathered into chunks of at least `combine` characters, each document followed by 50256."""
    end = corpus.end_of_document(encoder)
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


def _npz_chunks(file: str) -> list:
    """The token arrays of an .npz (gpt-2-simple's encode_dataset output)."""
    try:
        with np.load(file) as npz:
            return [np.asarray(npz[name]) for name in npz.files]
    except Exception as e:  # a damaged zip, object arrays (no pickles are loaded), ...
        raise GPT2Error(f'{file}: not an .npz of token arrays ({first_line(e)}); encode the text again') from None


def load_dataset(path: str, encoder: Encoder, combine: int = COMBINE, *, progress: Optional[Callable] = None,
                 pattern: Optional[str] = None) -> list:
    """Token chunks (int32 arrays) from a text file, a folder or glob of files, or an .npz of token arrays.

    An .npz (gpt-2-simple's encode_dataset output) loads as is, alone or among the files of a folder or
    glob, as gpt-2-simple reads them; a folder's files are all those not hidden, or those matching
    `pattern`. Text files are read as a token file's encoding reads them (corpus.file_pieces: line
    breaks as \n, a .csv as gpt-2-simple reads it), split into documents at lines that are exactly
    <|endoftext|>, and every document is followed by the end-of-text token 50256, as GPT-2 was trained
    (gpt-2-simple instead encoded that line as seven ordinary tokens).
    Documents are gathered into chunks of at least `combine` characters before
    encoding, as gpt-2-simple does; training windows never cross chunks.
    """
    path = os.fspath(path)
    check_integer('combine', combine, 1)
    files = _files(path, pattern)
    if not files:
        raise FileNotFoundError(f'no dataset at {path}: give a text file, a folder, a glob, or an .npz')
    texts = [f for f in files if not f.endswith('.npz')]
    chunks = [chunk for f in files if f.endswith('.npz') for chunk in _npz_chunks(f)]  # as gpt-2-simple reads them
    chunks += _encode_texts(texts, encoder, combine, progress) if texts else []
    chunks = [c for c in chunks if c.size]
    if not chunks:
        raise GPT2Error(f'the dataset at {path} is empty: no tokens in it')
    for chunk in chunks:
        validate.token_array(chunk, name='dataset tokens')
        validate.check_token_ids(chunk, encoder.n_vocab, name='dataset token')
    return [c.astype(np.int32) for c in chunks]


def encode_dataset(path: str, out_path: str, encoder: Encoder, combine: int = COMBINE, *,
                   pattern: Optional[str] = None) -> int:
    """Encodes a text dataset to an .npz of token chunks (gpt-2-simple's format); returns the token count.
    The .npz appears under its name only when complete."""
    chunks = load_dataset(path, encoder, combine, pattern=pattern)
    with replacing(out_path) as partial, open(partial, 'wb') as f:
        np.savez_compressed(f, *chunks)
    return int(sum(c.size for c in chunks))


def encode(inputs: list, out: str, *, glob: Optional[str] = None, processes: Optional[int] = None,
           combine: Optional[int] = None, progress: bool = False, model_dir: Optional[str] = None) -> dict:
    """`gpt2-tf encode`: text to a token file (OUT.bin, corpus.encode_corpus, streaming, in `processes`
    processes: the CPUs by default; a folder's *.txt files unless glob says others) or to gpt-2-simple's
    chunks (OUT.npz, encode_dataset, each input as load_dataset reads it, `combine` characters a chunk, 50000
    by default; a folder's files matching glob, every one by default); an option of the other kind is refused.
    model_dir: the model folder whose vocabulary encodes (corpus.vocabulary_of; default: the bundled GPT-2 one).
    progress: a bar on a terminal. Returns {'tokens', 'documents'} (documents: None for an .npz)."""
    out = os.fspath(out)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise GPT2Error(f'{folder} is not a folder: create it first, or write {os.path.basename(out)} elsewhere')
    files = corpus.vocabulary_of(model_dir)
    if out.endswith('.npz'):
        if '-' in inputs or len(inputs) != 1:
            raise GPT2Error('an .npz is encoded from one dataset (a file, folder or glob); for several inputs or '
                            'standard input write a token file: OUT.bin')
        if processes is not None:
            raise GPT2Error('processes is for a token file (.bin); an .npz is encoded in one process: leave it out')
        encoder = encoder_for(model_dir) if files else get_encoder()  # corpus.vocabulary_of's choice
        chunk = COMBINE if combine is None else combine
        return {'tokens': encode_dataset(inputs[0], out, encoder, chunk, pattern=glob), 'documents': None}
    if not out.endswith(TOKEN_FILE):
        raise GPT2Error(f'{out}: the output must end in {TOKEN_FILE} (a token file) or .npz (gpt-2-simple\'s chunks)')
    if combine is not None:
        raise GPT2Error('combine is for an .npz (gpt-2-simple\'s chunks of text); a token file keeps each document '
                        'whole: leave it out')
    glob = glob or '*.txt'
    processes = corpus.default_processes() if processes is None else processes
    bar, close = corpus.terminal_progress(inputs, glob=glob) if progress else (None, lambda finished=False: None)
    finished = False
    try:
        info = corpus.encode_corpus(inputs, out, glob=glob, processes=processes, progress=bar, encoder_files=files)
        finished = True
        return info
    finally:
        close(finished)


# --- token files, read in place ---------------------------------------------------------------------

def is_token_file(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(TOKEN_FILE)


def needs_vocabulary(dataset, config) -> bool:
    """Whether a fine-tuning run reads or writes text, so needs the model's vocabulary: a dataset or validation
    dataset that is not a token file, or samples. A token file trains without one, unsampled."""
    return (not is_token_file(dataset) or bool(config.sample_every)
            or (config.val_dataset is not None and not is_token_file(config.val_dataset)))


def check_token_file(path: str, n_vocab: int, model_dir: Optional[str] = None) -> dict:
    """A token file's sidecar ({} without one) once it agrees with the model: its ids fit n_vocab, and its
    vocabulary is the model folder's when the folder has one (a folder without vocabulary files trains too)."""
    info = corpus.read_sidecar(os.fspath(path)) or {}
    if info.get('n_vocab', 0) > n_vocab:
        raise GPT2Error(f'{path} was encoded with a vocabulary of {info["n_vocab"]:,} ids, and the model has '
                        f'{n_vocab:,}: encode the text with the model\'s vocabulary')
    if 'vocab_sha256' in info and model_dir is not None and vocabulary_files(model_dir):
        ours = corpus.vocabulary_sha256(encoder_for(model_dir))
        if ours != info['vocab_sha256']:
            raise GPT2Error(f'{path} was encoded with another vocabulary than {model_dir}\'s (sha256 '
                            f'{info["vocab_sha256"][:12]}..., the folder\'s {ours[:12]}...): encode the text with '
                            f'the model\'s vocabulary')
    return info


def token_windows(path: str, length: int, *, n_vocab: int, model_dir: Optional[str] = None,
                  seed: Optional[int] = None, val_fraction: float = 0.0, val_seed: Optional[int] = None) -> tuple:
    """(training windows, validation windows or None) over a token file, read in place (corpus.Windows).
    val_fraction > 0 holds out the file's last documents, about that fraction of its tokens."""
    tokens = corpus.read_tokens(path)
    info = check_token_file(path, n_vocab, model_dir)
    if 'n_vocab' not in info:  # a file without a sidecar says nothing of its ids: read them all once, in blocks
        corpus.check_ids(path, tokens.dtype, n_vocab)
    train, held_out = (0, len(tokens)), None
    if not val_fraction:
        return corpus.Windows(tokens, length, ranges=[train], seed=seed, name=str(path)), None
    train, held_out = corpus.split_documents(tokens, val_fraction, end=info.get('end_of_text', END_OF_TEXT_ID))
    parts = [corpus.Windows(tokens, length, ranges=[part], seed=part_seed,
                            name=f'{what} of {path} ({part[1] - part[0]:,} tokens)',
                            remedy=f'give more text, or {remedy}')
             for part, part_seed, what, remedy in ((train, seed, 'the training part', 'a smaller --val_fraction'),
                                                   (held_out, val_seed, 'the validation part',
                                                    'a larger --val_fraction'))]
    return tuple(parts)


class Sampler(corpus.Windows):
    """Random training windows of exactly `length` tokens, within one chunk each (load_dataset's chunks, held in
    memory), reproducible from a seed: a token file's Windows over the chunks laid end to end, one range each."""

    def __init__(self, chunks: list, length: int, seed: Optional[int] = None):
        longer = ('gather documents into longer chunks (a larger combine), or train on a token file (gpt2-tf '
                  'encode TEXT OUT.bin), whose windows cross documents')
        short = [len(c) for c in chunks if len(c) < length]
        if len(short) == len(chunks):
            longest = max(short, default=0)  # no chunk at all: none has a token
            raise GPT2Error(f'the dataset is shorter than one training window: its longest chunk has {longest} '
                            f'tokens, and a window is n_ctx = {length}; give more text, or {longer}')
        if short:  # gpt-2-simple's sampler never drew them either, without a word
            warnings.warn(f'{len(short)} of {len(chunks)} chunks of the dataset ({sum(short):,} tokens) are shorter '
                          f'than a training window (n_ctx = {length}) and are never trained on: {longer}',
                          stacklevel=2)
        ends = np.cumsum([len(c) for c in chunks])
        super().__init__(np.concatenate(chunks).astype(np.int32, copy=False), length,
                         ranges=list(zip(ends - [len(c) for c in chunks], ends)), seed=seed)
