"""Token files: a corpus encoded once into a flat file of ids, read in place through a memory map.

    encode_corpus(['docs/'], 'train.bin')     # every *.txt under docs/, in sorted path order
    tokens = read_tokens('train.bin')         # a read-only np.memmap [n_tokens]

The file holds the ids little-endian with no header, uint16 for vocabularies of
up to 65,536 ids (GPT-2's 50,257) and uint32 above, as nanoGPT's train.bin; a
small JSON sidecar beside it (train.bin.json) records the dtype, the
vocabulary's sha256, and the token and document counts. A .bin without a
sidecar reads as uint16. Each document (a file or standard input, or each part
of one between lines that are exactly <|endoftext|>; a .csv's rows, as
gpt-2-simple reads them) is its text's ids followed by <|endoftext|>; the text
is read as Python's text mode reads it (line breaks as \n), without line
breaks at the document's ends, as fine-tuning's text path reads it.

Text is read and encoded in pieces of about a million characters, cut only
where the pre-tokenizer always cuts (see `cut`), so the ids equal those of
encoding each file whole while memory stays bounded by the piece size. With
processes > 1 the pieces are encoded in parallel and written in order. The
output appears under its name only when complete (OUT.partial, then a rename).
No TensorFlow is imported.

Training reads the file in place: Windows draws windows of n_ctx tokens at
seeded random offsets within ranges of it, and split_documents holds out its
last documents for a validation range.
"""

from __future__ import annotations

import collections
import concurrent.futures
import csv
import glob as globbing
import hashlib
import io
import json
import os
import sys
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import regex

from . import interrupts
from .encoder import END_OF_TEXT, Encoder, get_encoder
from .validate import GPT2Error

PIECE = 1 << 20  # characters read and encoded at a time
SIDECAR = '.json'  # train.bin -> train.bin.json

# A position where every encoding of the text has a token boundary: after a letter before a non-letter, after
# a digit before a non-digit, after other non-space characters (punctuation, symbols) before whitespace, or
# after one whitespace character other than a space that stands between non-space characters (a single line
# break). No alternative of encoder.PATTERN crosses such a point (letter and digit runs stop there, punctuation
# runs hold neither letters, digits nor whitespace, whitespace runs hold only whitespace and only a space joins
# what follows it, contractions start with ' and stay within letters), and none looks ahead across it (the one
# lookahead, \s+(?!\S), ends a whitespace run: before a lone line break it sees what the piece holds), so the
# two sides encode as they do within the whole text. Text of letters and spaces alone cuts too.
CUT = regex.compile(r'(?<=\p{L})(?=\P{L})|(?<=\p{N})(?=\P{N})|(?<=[^\s\p{L}\p{N}])(?=\s)|(?<=\S[^\S ])(?=\S)')
TAILS = (256, 4096)  # characters searched, from the end, for the last cut before the whole piece is


def cut(text: str, start: int = 1) -> int:
    """The last position in text where it may be cut (see CUT), or 0 when there is none at start or after it
    (the positions before start are known to have none: a piece that found none is not searched again)."""
    for begin in [max(start, len(text) - tail) for tail in TAILS] + [start]:
        last = 0
        for match in CUT.finditer(text, pos=max(begin, 1)):
            last = match.start()
        if last:
            return last
    return 0


def lines(readable, size: int = PIECE) -> Iterator[Optional[str]]:
    """A text stream in blocks of about `size` characters, None for each line that is exactly <|endoftext|> (a
    separator: the line breaks next to it, blank lines included, go with it, as those at the stream's start
    and end go with its edges). Blocks holding no <|endoftext|> pass whole; only those that do are read line
    by line."""
    pending, breaks, line_start = '', None, True  # breaks: those read last, held until what follows is known
    while text := pending + (block := readable.read(size)):
        last = text[max(text.rfind('\n'), text.rfind('\r')) + 1:]
        pending = last if block and (END_OF_TEXT + '\r').startswith(last) else ''  # a separator may be forming
        ready = text[:len(text) - len(pending)]
        for line in io.StringIO(ready, newline='') if END_OF_TEXT in ready else [ready]:
            if line_start and line.rstrip('\r\n') == END_OF_TEXT:
                breaks = None  # those after it go with it too
                yield None
                continue
            line = line if breaks is not None else line.lstrip('\r\n')
            body = line.rstrip('\r\n')
            line_start = len(body) < len(line) or (not line and line_start)
            if body:
                yield (breaks or '') + body
                breaks = ''
            if breaks is not None:
                breaks += line[len(body):]


def pieces(readable, size: int = PIECE) -> Iterator[Optional[str]]:
    """A text stream's documents in pieces of about `size` characters, each ending at a cut (the last at the
    document's end), and None after each document. Documents are the parts between separator lines (see
    `lines`), without line breaks at their ends; empty ones are left out."""
    buffer, length, started = [], 0, False
    searched = 1  # the buffer's positions before this have no cut (each needs the character after it)
    for block in lines(readable, size):
        if block is not None:
            buffer.append(block)
            length += len(block)
            if length < size:
                continue
            text = ''.join(buffer)
            at = cut(text, searched)
            if at == 0:  # no cut in it (a run of spaces, say): keep reading, searching only what is new
                buffer, length, searched = [text], len(text), len(text)
                continue
            yield text[:at]
            started, buffer, length = True, [text[at:]], len(text) - at
            searched = max(length, 1)  # the last cut was at `at`: none after it
            continue
        if buffer or started:
            if buffer:
                yield ''.join(buffer)
            yield None
        buffer, length, started, searched = [], 0, False, 1
    if buffer or started:
        if buffer:
            yield ''.join(buffer)
        yield None


def dtype_for(n_vocab: int) -> np.dtype:
    return np.dtype('<u2') if n_vocab <= 1 << 16 else np.dtype('<u4')


def vocabulary_sha256(encoder: Encoder) -> str:
    """The sha256 of the vocabulary as ids: the same for the same token table, whatever its file."""
    table = json.dumps(sorted(encoder.encoder.items(), key=lambda item: item[1]), ensure_ascii=False)
    return hashlib.sha256(table.encode('utf-8')).hexdigest()


def documents(inputs: Sequence[str], *, glob: str = '*.txt') -> list:
    """The files a list of inputs names, in order: files as given, folders' matches (recursively,
    sorted by path), '-' for standard input."""
    found = []
    for item in inputs:
        item = os.fspath(item)
        if item == '-':
            found.append('-')
        elif os.path.isdir(item):
            matches = globbing.glob(os.path.join(globbing.escape(item), '**', glob), recursive=True)
            found.extend(sorted(p for p in matches if os.path.isfile(p)))
        elif os.path.isfile(item):
            found.append(item)
        else:
            raise GPT2Error(f'{item}: no such file or folder; give text files, folders, or - for standard input')
    if not found:
        raise GPT2Error(f'no {glob} files under {", ".join(map(str, inputs))}; pass --glob to match others')
    return found


TEXT_ENCODING = 'utf-8-sig'  # UTF-8, less a leading byte-order mark (Windows editors write one; it is not text)


def open_text(path: str, newline: Optional[str] = None):
    """A text file (or '-', standard input) read as UTF-8 (TEXT_ENCODING), its line breaks as '\n' (Python's
    text mode)."""
    if path == '-':
        return open(sys.stdin.fileno(), encoding=TEXT_ENCODING, newline=newline, closefd=False)
    return open(path, encoding=TEXT_ENCODING, newline=newline)


CSV_START = '<|startoftext|>'  # gpt-2-simple's start marker for each CSV row, kept as text


def _csv_rows(f) -> Iterator[str]:
    """gpt-2-simple's CSV convention: the header skipped, each row's first column a document, after
    <|startoftext|> (its line breaks as '\n')."""
    reader = csv.reader(f)
    next(reader, None)
    for row in reader:
        if row and row[0]:
            yield CSV_START + row[0].replace('\r\n', '\n').replace('\r', '\n')


def file_pieces(path: str, size: int = PIECE, *, opener=None) -> Iterator[Optional[str]]:
    """A file's documents (`pieces`; a .csv's rows, gpt-2-simple's way) in pieces, None after each; a file
    that is not UTF-8 is refused naming its first invalid byte. opener: a function opening the file's bytes
    (a Beam file system's), else the file is opened here."""
    newline = '' if path.endswith('.csv') else None  # the csv module reads quoted line breaks itself
    try:
        with (io.TextIOWrapper(opener(), encoding=TEXT_ENCODING, newline=newline) if opener is not None
              else open_text(path, newline)) as f:
            if path.endswith('.csv'):
                for row in _csv_rows(f):
                    yield from pieces(io.StringIO(row), size)
            else:
                yield from pieces(f, size)
    except UnicodeDecodeError as e:
        where = '' if path == '-' else f' at byte {_first_invalid_byte(opener or (lambda: open(path, "rb"))):,}'
        raise GPT2Error(f'{path}: not UTF-8 text ({e.reason}{where}); convert it to UTF-8 or leave it out') from None
    except csv.Error as e:  # a malformed or oversized field
        raise GPT2Error(f'{path}: not a CSV file csv.reader can read ({e}); fix it or leave it out') from None


def _first_invalid_byte(opener, block: int = 1 << 20) -> int:
    """The offset of a file's first byte that is not UTF-8, read again from its start through opener (a
    UnicodeDecodeError's start counts from the text layer's last read, not the file's start)."""
    import codecs

    decoder, done = codecs.getincrementaldecoder('utf-8')(), 0
    with opener() as f:
        while True:
            data = f.read(block)
            held = len(decoder.getstate()[0])  # an unfinished character from the block before
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                return done - held + e.start
            if not data:
                return done
            done += len(data)


def ids_of(encoder: Encoder, piece: str) -> np.ndarray:
    """encoder.encode(piece) as an array of the token file's dtype."""
    return np.array(encoder.encode(piece), dtype_for(encoder.n_vocab))


def _encode(piece: str) -> np.ndarray:
    return ids_of(_worker_encoder, piece)


_worker_encoder = None


def _start_worker(encoder_files) -> None:
    global _worker_encoder
    from .encoder import _cached_encoder
    _worker_encoder = _cached_encoder(*encoder_files, None) if encoder_files else get_encoder()


def _start_pool_worker(encoder_files) -> None:
    """A pool worker: Ctrl-C is the parent's to handle (it stops the pool), not each worker's traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _start_worker(encoder_files)


def _document_pieces(files: Iterable[str], size: int) -> Iterator[tuple]:
    """(file, piece) for every piece of every file, and (file, None) at the end of each of its documents."""
    for path in files:
        for piece in file_pieces(path, size):
            yield path, piece


class _Writer:
    """Appends ids to OUT.partial, counting tokens and documents, and moves it into place at the end."""

    def __init__(self, out: str, n_vocab: int, end: int):
        self.out, self.partial = out, out + '.partial'
        self.dtype, self.n_vocab, self.end = dtype_for(n_vocab), n_vocab, end
        self.file = open(self.partial, 'wb')
        self.tokens = self.documents = 0

    def write(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) >= self.n_vocab:
            raise GPT2Error(f'token id {int(ids.max())} is outside the vocabulary [0, {self.n_vocab})')
        self.file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.tokens += ids.size

    def end_document(self) -> None:
        self.write(np.asarray([self.end], np.uint32))
        self.documents += 1

    def finish(self, sidecar: dict) -> None:
        self.file.close()
        with open(self.out + SIDECAR + '.partial', 'w', encoding='utf-8') as f:
            json.dump(sidecar, f, indent=2)
            f.write('\n')
        with interrupts.deferred():  # the two together: a .bin beside an older run's sidecar reads as that run's
            os.replace(self.partial, self.out)
            os.replace(self.out + SIDECAR + '.partial', self.out + SIDECAR)

    def abandon(self) -> None:
        self.file.close()
        for path in (self.partial, self.out + SIDECAR + '.partial'):
            if os.path.exists(path):
                os.remove(path)


def encode_corpus(inputs: Sequence[str], out: str | os.PathLike, *, encoder: Optional[Encoder] = None,
                  encoder_files: Optional[tuple] = None, glob: str = '*.txt', processes: int = 1,
                  piece: int = PIECE, progress=None) -> dict:
    """Encodes text files, folders or '-' (stdin) into the token file `out`; returns its sidecar.

    encoder_files: (encoder.json, vocab.bpe) of another vocabulary than GPT-2's
    bundled one (encoder, when given instead, is used in this process only, so
    processes must then be 1). progress, when given, is called with
    (bytes, tokens) after each piece (see terminal_progress). An interrupted
    run leaves no `out` (an interrupt as the finished files move into place
    is held until both are there).
    """
    out = os.fspath(out)
    files = documents(inputs, glob=glob)
    if encoder is not None and processes != 1:
        raise GPT2Error('an Encoder object can be used by one process only: pass encoder_files instead')
    if not isinstance(processes, int) or processes < 1:
        raise GPT2Error(f'processes must be an integer >= 1, got {processes!r}')
    if encoder is None:
        _start_worker(encoder_files)
        encoder = _worker_encoder
    writer = _Writer(out, encoder.n_vocab, end_of_document(encoder))
    try:
        _encode_into(writer, _document_pieces(files, piece), encoder, encoder_files, processes, progress)
        check_text(writer.tokens, inputs)
        sidecar = sidecar_of(encoder, writer.tokens, writer.documents)
        writer.finish(sidecar)
    except BaseException:
        writer.abandon()
        raise
    return sidecar


def sidecar_of(encoder: Encoder, tokens: int, documents: int) -> dict:
    """A token file's sidecar: its ids' dtype, the vocabulary that made them, and its counts."""
    return {'dtype': dtype_for(encoder.n_vocab).name, 'n_vocab': encoder.n_vocab,
            'vocab_sha256': vocabulary_sha256(encoder), 'tokens': tokens, 'documents': documents,
            'end_of_text': end_of_document(encoder)}


def end_of_document(encoder: Encoder) -> int:
    """<|endoftext|>'s id, which ends each document of encoded text (a token file, an .npz, fine-tuning's text);
    refused in one line where the vocabulary has none."""
    return encoder.end_of_text('encoded text ends each document with', 'add it to the vocabulary, or use one that '
                               'has it (GPT-2\'s: without --model_dir)')


def vocabulary_of(model_dir: Optional[str]) -> Optional[tuple]:
    """The vocabulary files text is encoded with for model_dir (encode's --model_dir, Beam's too): the folder's
    own pair, else a one-line refusal (a folder without one, with one the encoder cannot read, or with one
    without <|endoftext|>); None (GPT-2's bundled pair) without model_dir."""
    from .encoder import encoder_for, vocabulary_files

    if model_dir is None:
        return None
    # Before any work: a vocabulary the encoder cannot read (added tokens, another kind of tokenizer.json, said
    # first), or one without the token that ends each document.
    end_of_document(encoder_for(model_dir))
    files = vocabulary_files(model_dir)
    if not files:
        raise GPT2Error(f'{model_dir} has no vocabulary files (encoder.json and vocab.bpe, or vocab.json and '
                        f'merges.txt); leave out --model_dir to encode with the bundled GPT-2 vocabulary')
    return files


def encoder_of(model_dir: Optional[str]) -> Encoder:
    """The encoder of vocabulary_of(model_dir): the folder's own vocabulary, else a one-line refusal; GPT-2's
    bundled one without model_dir."""
    from .encoder import encoder_for

    return get_encoder() if vocabulary_of(model_dir) is None else encoder_for(model_dir)


def check_text(tokens: int, inputs: Sequence) -> None:
    """Refuses an encoding that found no text (a token file of no tokens would only fail later, in training)."""
    if not tokens:
        raise GPT2Error(f'no text in {", ".join(map(str, inputs))}: nothing to encode (empty documents are left out)')


def _encode_into(writer: _Writer, stream: Iterator[tuple], encoder: Encoder, encoder_files, processes: int,
                 progress) -> None:
    """Encodes the stream's pieces (in `processes` processes, at most 2 pieces each in flight) in order."""
    def done(piece: Optional[str], ids: Optional[np.ndarray]) -> None:
        if piece is None:
            writer.end_document()
            if progress:
                progress(0, 1)
            return
        writer.write(ids)
        if progress:
            progress(len(piece.encode('utf-8')), ids.size)

    if processes == 1:
        for _, piece in stream:
            done(piece, None if piece is None else ids_of(encoder, piece))
        return
    with concurrent.futures.ProcessPoolExecutor(processes, initializer=_start_pool_worker,
                                                initargs=(encoder_files,)) as pool:
        pending = collections.deque()
        for _, piece in stream:
            pending.append((piece, None if piece is None else pool.submit(_encode, piece)))
            while len(pending) > 2 * processes or (pending and pending[0][1] is None):
                first, future = pending.popleft()
                done(first, None if future is None else future.result())
        while pending:
            first, future = pending.popleft()
            done(first, None if future is None else future.result())


def default_processes(cpu_max: str = '/sys/fs/cgroup/cpu.max') -> int:
    """The CPUs this process may run on, within a container's CPU quota (cgroup v2's cpu.max: a 2-CPU
    container on a 64-CPU host gets 2, not 64 workers of about 100 MB each)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1
    try:
        with open(cpu_max, encoding='ascii') as f:
            quota, period = f.read().split()[:2]
        if quota != 'max':
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 here, or a file of another shape: the CPUs alone
        pass
    return cpus


def terminal_progress(inputs: Sequence[str], *, glob: str = '*.txt', stream=None):
    """(progress, close) for encode_corpus: a tqdm bar of bytes read, with tokens/s, when `stream`
    (standard error) is a terminal; (None, a no-op) otherwise. close(finished=True) fills the bar first
    (the bytes counted are the text's as read: line breaks read as \n, those dropped at document ends and
    a .csv's other columns count none)."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None, lambda finished=False: None
    from tqdm import tqdm

    files = documents(inputs, glob=glob)
    total = None if '-' in files else sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit='B', unit_scale=True, file=stream, desc='encoding')
    counts = {'tokens': 0}

    def progress(size: int, tokens: int) -> None:
        counts['tokens'] += tokens
        elapsed = bar.format_dict['elapsed'] or 1e-9
        bar.set_postfix_str(f'{counts["tokens"]:,} tokens, {counts["tokens"] / elapsed:,.0f} tokens/s', refresh=False)
        bar.update(size)

    def close(finished: bool = False) -> None:
        if finished and bar.total:
            bar.update(bar.total - bar.n)
        bar.close()

    return progress, close


def read_tokens(path: str | os.PathLike) -> np.memmap:
    """A token file as a read-only memory map of its ids (uint16 without a sidecar, as nanoGPT's files)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GPT2Error(f'no token file at {path}; make one with: gpt2-tf encode TEXT... {path}')
    info = read_sidecar(path)
    dtype = np.dtype(info['dtype']).newbyteorder('<') if info else np.dtype('<u2')
    size = os.path.getsize(path)
    if info and size != info['tokens'] * dtype.itemsize:
        raise GPT2Error(f'{path}: {size:,} bytes do not hold the {info["tokens"]:,} {dtype.name} ids its sidecar '
                        f'describes; the file is truncated: encode it again')
    if size % dtype.itemsize:
        raise GPT2Error(f'{path}: {size:,} bytes are not whole {dtype.name} ids (a .bin without a sidecar is read '
                        f'as uint16); the file is truncated: encode it again')
    if size == 0:
        raise GPT2Error(f'{path} is empty: it holds no tokens')
    return np.memmap(path, dtype=dtype, mode='r')


def read_sidecar(path: str) -> Optional[dict]:
    """The sidecar of a token file, or None when it has none."""
    try:
        with open(path + SIDECAR, encoding='utf-8') as f:
            info = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise GPT2Error(f'{path + SIDECAR}: not a token-file sidecar ({e}); remove it to read {path} as uint16') from None
    if info.get('dtype') not in ('uint16', 'uint32') or not isinstance(info.get('tokens'), int):
        raise GPT2Error(f'{path + SIDECAR}: expected "dtype" uint16 or uint32 and an integer "tokens"')
    return info


def split_documents(tokens: np.ndarray, fraction: float, *, end: int) -> tuple:
    """(train, validation) ranges [start, stop) of a token file: the validation range is its last
    documents, about `fraction` of the tokens, cut just after an <|endoftext|>."""
    if not 0 < fraction < 1:
        raise GPT2Error(f'the validation fraction must be in (0, 1), got {fraction!r}')
    n = len(tokens)
    at = int(n * (1 - fraction))
    step = 1 << 16
    while at > 0:  # backwards, a block at a time, to the end of the document that holds position at
        block = np.asarray(tokens[max(0, at - step):at])
        ends = np.flatnonzero(block == end)
        if ends.size:
            split = max(0, at - step) + int(ends[-1]) + 1
            if split < (1 - fraction) * n / 2:  # a long last document: most of the file would be held out
                raise GPT2Error(f'holding out whole documents leaves {split / n:.1%} of the tokens for training, '
                                f'not about {1 - fraction:.0%} (the documents after token {split:,} are one long '
                                f'run): give --val_dataset a file of its own')
            return (0, split), (split, n)
        at -= step
    raise GPT2Error(f'the token file has no <|endoftext|> (id {end}) before its last {fraction:.0%}: '
                    f'a validation split by document needs at least two documents')


def check_ids(path: str, dtype: np.dtype, n_vocab: int, *, block: int = 1 << 22) -> None:
    """Refuses a token file holding an id outside [0, n_vocab), naming the first; read in blocks through a
    plain file (not the memory map), so the check holds one block at a time."""
    with open(path, 'rb') as f:
        done = 0
        while True:
            ids = np.fromfile(f, dtype=dtype, count=block)
            if not ids.size:
                return
            outside = np.flatnonzero(ids >= n_vocab)
            if outside.size:
                at = int(outside[0])
                raise GPT2Error(f'{path} holds token id {int(ids[at])} at token {done + at:,}, outside the model\'s '
                                f'vocabulary [0, {n_vocab}): encode it with this model\'s vocabulary')
            done += ids.size


def skip(rng: np.random.Generator, high: int, batches: int, batch: int) -> None:
    """Advances rng as `batches` draws of `batch` window starts in [0, high) advance it (a resumed run)."""
    for _ in range(batches):
        rng.integers(0, high, size=batch)


class Windows:
    """Training windows of exactly `length` tokens at random offsets within given ranges of a token file,
    read in place (memory does not grow with the file) and reproducible from a seed."""

    def __init__(self, tokens: np.ndarray, length: int, *, ranges: Optional[Sequence[tuple]] = None,
                 seed: Optional[int] = None, name: str = 'the token file', remedy: str = 'give more text'):
        ranges = [tuple(r) for r in (ranges or [(0, len(tokens))]) if r[1] - r[0] >= length]
        if not ranges:
            raise GPT2Error(f'{name} is shorter than one training window of {length} tokens (n_ctx): {remedy}')
        self.tokens, self.length, self.ranges, self.name = tokens, length, ranges, name
        # A window starts at any of the stop - start - length + 1 offsets of a range, each equally likely.
        self.starts = np.cumsum([stop - start - length + 1 for start, stop in ranges])
        self.rng = np.random.default_rng(seed)

    def skip(self, batches: int, batch: int) -> None:
        """Draws as `batches` calls of sample(batch) draw, reading nothing: where a resumed run goes on."""
        skip(self.rng, self.starts[-1], batches, batch)

    def sample(self, batch: int, rng: Optional[np.random.Generator] = None) -> np.ndarray:  # -> int32 [batch, length]
        """batch windows, drawn with this sampler's generator (or rng, leaving it as it was)."""
        picks = (rng or self.rng).integers(0, self.starts[-1], size=batch)
        rows = []
        for pick in picks:
            i = int(np.searchsorted(self.starts, pick, side='right'))
            offset = self.ranges[i][0] + pick - (self.starts[i - 1] if i else 0)
            rows.append(np.asarray(self.tokens[offset:offset + self.length], np.int32))
        return np.stack(rows)
