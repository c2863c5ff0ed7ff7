"""GPT-2's byte-level BPE, after openai/gpt-2 src/encoder.py.

Text becomes UTF-8 bytes, each byte a printable stand-in character, then the
pre-tokenising regex splits it into words and BPE merges each word by rank.
When tiktoken is installed, an Encoding built locally from the same two files
does the same work in Rust; the pure-Python path stays as the reference and
the fallback, and the tests hold the two to the same ids.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import json
import os
import re
import shutil
import tempfile
from typing import Iterable, Optional, Sequence

import regex

from .assets import bundled_vocabulary
from .quiet import cache_folder, remove_stale
from .validate import GPT2Error, first_line, is_int, shown

END_OF_TEXT = '<|endoftext|>'
END_OF_TEXT_ID = 50256  # its id in GPT-2's vocabulary: every document's end, and the context evaluations start from

# The original pattern, kept without IGNORECASE: "I'M" splits as "I", "'", "M", as GPT-2 was trained.
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class VocabularyNotFound(GPT2Error, FileNotFoundError):
    """A vocabulary file that is not where the folder needs it."""


@functools.lru_cache()
def bytes_to_unicode() -> dict:
    """A printable character for each byte, so BPE never sees whitespace or control characters.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the
    characters from U+0100 on, in byte order.
    """
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return dict(sorted(table.items()))


def merge_by_rank(word: str, ranks: dict) -> list:
    """word's symbols after the original's merges: each round merges the pair of lowest rank wherever it stands,
    left to right and without overlap (with the merge 'a a', 'aaa' becomes 'aa a'), until no pair has a rank.

    The original recomputes every pair each round, O(n^2) on a long word without whitespace; here the symbols
    are a linked list by their first character's position, and a heap holds (rank, position) for each pair,
    those a merge made stale skipped as they come up: O(n log n).
    """
    symbols = list(word)
    after = [*range(1, len(word)), None]  # the next symbol's position; None at the end
    before = [None, *range(len(word) - 1)]
    heap = [(ranks[pair], i) for i, pair in enumerate(zip(word, word[1:])) if pair in ranks]
    heapq.heapify(heap)

    def push(i: Optional[int]) -> None:  # the pair that starts at i, where it has a rank
        if i is not None and after[i] is not None:
            rank = ranks.get((symbols[i], symbols[after[i]]))
            if rank is not None:
                heapq.heappush(heap, (rank, i))
    while heap:
        rank = heap[0][0]
        due = []  # one round: every place of the one pair of this rank, left to right (the pops come in order)
        while heap and heap[0][0] == rank:
            due.append(heapq.heappop(heap)[1])
        # Only now do merges push the pairs they make: the original ends a round before it looks at any of them,
        # even at one of a lower rank.
        for i in due:
            j = after[i]
            if symbols[i] is None or j is None or ranks.get((symbols[i], symbols[j])) != rank:
                continue  # merged into its left neighbour (an overlap), or its pair has changed since
            symbols[i], symbols[j] = symbols[i] + symbols[j], None
            after[i] = after[j]
            if after[i] is not None:
                before[after[i]] = i
            push(before[i])
            push(i)
    return [symbol for symbol in symbols if symbol is not None]


@functools.lru_cache(maxsize=1)
def _gpt2_vocabulary() -> tuple:
    encoder, merges = _read_files(*bundled_vocabulary())
    return encoder, merges


def _tiktoken_encoding(encoder: dict, bpe_merges: Sequence[tuple]):
    """A tiktoken Encoding with the same ids, or None when tiktoken is missing or the vocabulary is not GPT-2's.

    tiktoken merges by the rank of the merged token, the original by the rank of
    the pair. The two agree on GPT-2's files (the tests hold them to the same ids),
    but not on every vocabulary: with merges (a, b), (b, c), (a, bc) they encode
    'abc' differently. So the fast path is used only for GPT-2's own vocabulary.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    gpt2_encoder, gpt2_merges = _gpt2_vocabulary()
    if len(encoder) != len(gpt2_encoder) or list(map(tuple, bpe_merges)) != gpt2_merges or encoder != gpt2_encoder:
        return None
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_decoder[c] for c in symbol): rank for symbol, rank in encoder.items() if symbol != END_OF_TEXT}
    special = {END_OF_TEXT: encoder[END_OF_TEXT]} if END_OF_TEXT in encoder else {}
    return tiktoken.Encoding('gpt2_tf', pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=special,
                             explicit_n_vocab=len(encoder))


BLANK_RUN = 1 << 17  # tiktoken's regex engine panics on a run of about 10^6 whitespace characters; well short of it
_BLANK_BLOCK = re.compile(r'\s{%d}' % (BLANK_RUN // 2))  # Python's \s: all of Unicode's White_Space, and \x1c-\x1f


def _long_blank(text: str) -> bool:
    """Whether text may hold a run of BLANK_RUN whitespace characters or more (any mix: ' \\t\\n', U+2003, ...).
    Such a run covers a whole block of BLANK_RUN // 2 that starts at a multiple of BLANK_RUN // 2, so only those
    blocks are tried: 20 us for 9 MB of source code, where a search of every run took 170 ms and tiktoken's
    encode 750. A shorter run found so (from BLANK_RUN // 2) only takes the original's way, to the same ids."""
    block = BLANK_RUN // 2
    return len(text) >= BLANK_RUN and any(_BLANK_BLOCK.match(text, start)
                                          for start in range(0, len(text) - block + 1, block))


class Encoder:
    """encode(text) -> ids and decode(ids) -> text, identical to the original encoder.

    fast: None uses tiktoken when it is installed, True requires it, False uses
    the pure-Python path. `backend` says which one runs.
    """

    def __init__(self, encoder: dict, bpe_merges: Sequence[tuple], errors: str = 'replace', *,
                 fast: Optional[bool] = None):
        self.encoder = encoder
        self.decoder = {v: k for k, v in encoder.items()}
        self.errors = errors  # how to handle invalid UTF-8 when decoding
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.bpe_ranks = {tuple(pair): rank for rank, pair in enumerate(bpe_merges)}
        self.cache = {}
        self.pat = regex.compile(PATTERN)
        self._tiktoken = None if fast is False else _tiktoken_encoding(encoder, bpe_merges)
        if fast and self._tiktoken is None:
            raise GPT2Error("fast=True needs tiktoken installed and GPT-2's own vocabulary files")
        self.backend = 'python' if self._tiktoken is None else 'tiktoken'

    @property
    def n_vocab(self) -> int:
        return len(self.encoder)

    def bpe(self, token: str) -> str:
        """Merges a word's symbols by rank; returns them joined by spaces."""
        if token not in self.cache:
            self.cache[token] = ' '.join(merge_by_rank(token, self.bpe_ranks))
        return self.cache[token]

    def _encode_ordinary(self, text: str) -> list:
        if self._tiktoken is not None and not _long_blank(text):
            try:
                return self._tiktoken.encode_ordinary(text)  # the same ids; no scan for special tokens
            except BaseException as e:  # its regex engine gives up on a run of about 10^6 blanks: a Rust panic,
                if type(e).__name__ != 'PanicException':  # which is no Exception; the original's way takes it
                    raise
        ids = []
        for piece in self.pat.findall(well_formed(text)):
            piece = ''.join(self.byte_encoder[b] for b in piece.encode('utf-8'))
            ids.extend(self.encoder[symbol] for symbol in self.bpe(piece).split(' '))
        return ids

    def encode(self, text: str, *, special: bool = False) -> list:
        """Token ids for text. As in the original, '<|endoftext|>' in text is ordinary text;
        with special=True it is read as the end-of-text token, id 50256."""
        if not isinstance(text, str):
            raise TypeError(f'encode takes a str, got {type(text).__name__}')
        if not special:
            return self._encode_ordinary(text)
        parts = text.split(END_OF_TEXT)
        if len(parts) > 1:  # a vocabulary without it still encodes text that does not hold it
            end = self.end_of_text('special=True reads', 'encode with special=False, where it is text')
        ids = []
        for i, part in enumerate(parts):
            if i:
                ids.append(end)
            ids.extend(self._encode_ordinary(part))
        return ids

    def end_of_text(self, use: str, remedy: str) -> int:
        """<|endoftext|>'s id, for what `use` says needs it ('a token file ends each document with'); a vocabulary
        without it is refused in one line, with the next step (remedy), before any work."""
        if END_OF_TEXT not in self.encoder:
            raise GPT2Error(f'{use} {END_OF_TEXT}, which this vocabulary does not have: {remedy}')
        return self.encoder[END_OF_TEXT]

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token id of this vocabulary."""
        return bytes(self.byte_decoder[c] for c in self.decoder[token])

    def _ids(self, tokens: Iterable[int]) -> list:
        """tokens as Python ints, each an id of this vocabulary."""
        tokens = list(tokens)
        odd = [t for t in tokens if not is_int(t)]
        if odd:
            raise GPT2Error(f'token ids are integers, got {shown(odd[0])}')
        tokens = [int(t) for t in tokens]
        bad = [t for t in tokens if t not in self.decoder]
        if bad:
            raise GPT2Error(f'token id {bad[0]} is outside the vocabulary [0, {self.n_vocab}), which has no text for '
                            f'it (a model of a larger n_vocab draws such ids: give it the vocabulary made for it)')
        return tokens

    def decode(self, tokens: Iterable[int]) -> str:
        tokens = self._ids(tokens)
        if self._tiktoken is not None:
            return self._tiktoken.decode(tokens, errors=self.errors)
        symbols = ''.join(self.decoder[t] for t in tokens)
        return bytes(self.byte_decoder[c] for c in symbols).decode('utf-8', errors=self.errors)


def _read_files(encoder_path: str, bpe_path: str):
    try:
        with open(encoder_path, encoding='utf-8') as f:
            encoder = json.load(f)
    except FileNotFoundError:
        raise VocabularyNotFound(f'no encoder.json at {encoder_path}') from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GPT2Error(f'{encoder_path}: not valid JSON ({e})') from None
    _check_encoder(encoder, encoder_path)
    try:
        with open(bpe_path, encoding='utf-8') as f:
            lines = f.read().split('\n')
    except FileNotFoundError:
        raise VocabularyNotFound(f'no vocab.bpe at {bpe_path}') from None
    except UnicodeDecodeError as e:
        raise GPT2Error(f'{bpe_path}: not UTF-8 text ({e})') from None
    if not lines[0].startswith('#version'):
        raise GPT2Error(f'{bpe_path}: expected a "#version" header line, got {lines[0][:40]!r}')
    return encoder, _merges(enumerate(lines[1:], start=2), encoder, f'{bpe_path}, line', os.path.basename(encoder_path))


def _check_encoder(encoder, where: str) -> None:
    """A token table byte-level BPE can use: token strings to the ids 0 .. n-1, each once, with every byte's
    symbol (bytes_to_unicode) among them and no other character in any (encode and decode look each one up)."""
    if not isinstance(encoder, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in encoder.items()):
        raise GPT2Error(f'{where}: expected a JSON object mapping token strings to integer ids')
    if sorted(encoder.values()) != list(range(len(encoder))):
        raise GPT2Error(f'{where}: ids must be 0 .. {len(encoder) - 1}, each once')
    missing = [(b, c) for b, c in bytes_to_unicode().items() if c not in encoder]
    if missing:
        raise GPT2Error(f'{where}: no token for byte 0x{missing[0][0]:02x} ({missing[0][1]!r}); a byte-level BPE '
                        f'vocabulary has all 256 byte symbols: give the vocabulary\'s complete file')
    odd = _NO_BYTE.search(''.join(encoder))  # 2 ms for GPT-2's 50257 tokens
    if odd:
        token = next(t for t in encoder if odd.group() in t)
        raise GPT2Error(f'{where}: token {token!r} holds {odd.group()!r}, which stands for no byte '
                        f'(bytes_to_unicode): not a byte-level BPE vocabulary such as GPT-2\'s')


_NO_BYTE = re.compile('[^%s]' % re.escape(''.join(bytes_to_unicode().values())))  # a character no byte stands for


def _merges(lines: Iterable[tuple], encoder: dict, where: str, table: str) -> list:
    """The merges of numbered lines ('a b'; empty lines skipped): each two symbols whose join is a token of
    encoder (read from `table`); the first other one is refused in one line, named by where and its number."""
    merges = []
    for number, line in lines:
        if not line:
            continue
        pair = tuple(line.split())
        if len(pair) != 2:
            raise GPT2Error(f'{where} {number}: expected two symbols, got {line[:40]!r}')
        if pair[0] + pair[1] not in encoder:
            raise GPT2Error(f'{where} {number}: merge {line!r} makes a token missing from {table}')
        merges.append(pair)
    return merges


TOKENIZER_JSON = 'tokenizer.json'
CACHE_ENV = 'GPT2_TF_VOCABULARY_CACHE'  # where a tokenizer.json's vocabulary is kept as vocab.json and merges.txt
CACHED = ('vocab.json', 'merges.txt')  # the pair the vocabulary cache holds for a tokenizer.json
# The BPE model's options that change ids, and the values GPT-2's takes (the first: the tokenizers default).
GPT2_BPE = {'dropout': (None,), 'continuing_subword_prefix': (None, ''), 'end_of_word_suffix': (None, ''),
            'byte_fallback': (False,), 'ignore_merges': (False,)}


def _tokenizer_pair(path: str) -> tuple:
    """(vocab.json, merges.txt) holding the vocabulary of an HF tokenizer.json of GPT-2's kind (_differs), written
    once into the vocabulary cache (quiet.cache_folder) under its sha256: the pair is what the encoder reads, and
    what a written folder copies (save_hf, a run folder). Another kind of tokenizer is refused in one line saying
    what differs."""
    with open(path, 'rb') as f:
        content = f.read()
    folder = os.path.join(cache_folder(CACHE_ENV, 'vocabularies'), hashlib.sha256(content).hexdigest()[:16])
    files = tuple(os.path.join(folder, name) for name in CACHED)
    if os.path.isdir(folder):  # the same bytes were read, checked and written before
        return files
    try:
        tokenizer = json.loads(content)
    except ValueError as e:
        raise GPT2Error(f'{path}: not valid JSON ({e})') from None
    differs = _differs(tokenizer)
    if differs:
        raise GPT2Error(f'{os.path.dirname(path) or "."} has only a tokenizer.json, and its {differs}: this encoder '
                        f'reads GPT-2\'s byte-level BPE alone. The model loads; for text, use the folder\'s own '
                        f'tokenizer')
    vocab = tokenizer['model']['vocab']
    _check_encoder(vocab, f'{path} (model.vocab)')
    lines = [m if isinstance(m, str) else ' '.join(m) for m in tokenizer['model']['merges']]
    merges = _merges(enumerate(lines), vocab, f'{path}, model.merges', 'model.vocab')
    _write_pair(folder, vocab, merges)
    return files


def _differs(tokenizer) -> Optional[str]:
    """What makes an HF tokenizer.json other than GPT-2's byte-level BPE (a phrase), or None: a BPE model with
    GPT2_BPE's options, GPT-2's pre-tokenizer (_splits_as_gpt2), no normalizer, and <|endoftext|>, where it is an
    added token, at its model.vocab id."""
    model = tokenizer.get('model') if isinstance(tokenizer, dict) else None
    model = model if isinstance(model, dict) else {}
    # Older tokenizers versions wrote a BPE model without its type (Hugging Face's gpt2 tokenizer.json among them).
    if model.get('type', 'BPE') != 'BPE' or not isinstance(model.get('vocab'), dict) or \
            not isinstance(model.get('merges'), list):
        return f'model is not a BPE with a vocab and merges (type {shown(model.get("type"))})'
    if not all(isinstance(m, str) or isinstance(m, list) and all(isinstance(s, str) for s in m)
               for m in model['merges']):  # "a b", or ["a", "b"] from tokenizers 0.20 on
        return 'model.merges holds an entry other than "a b" or ["a", "b"]'
    odd = [f'{name}={shown(model[name])}' for name, ours in GPT2_BPE.items() if model.get(name, ours[0]) not in ours]
    if odd:
        return f'BPE model sets {odd[0]}'
    if tokenizer.get('normalizer') is not None:
        return 'normalizer changes the text first'
    if not _splits_as_gpt2(tokenizer.get('pre_tokenizer') or {}):
        return 'pre-tokenizer is not ByteLevel alone, without a prefix space and with GPT-2\'s regex'
    end = [t.get('id') for t in _added(tokenizer) if t.get('content') == END_OF_TEXT]
    if end and end[0] != model['vocab'].get(END_OF_TEXT):
        return f'{END_OF_TEXT} is an added token at id {end[0]}, not its model.vocab id'
    return None


# GPT-2's regex as a Split step, exactly as tokenizers writes Split(Regex(PATTERN), behavior='isolated'): each match
# a piece of its own, the pieces ByteLevel(use_regex=True) makes.
GPT2_SPLIT = {'type': 'Split', 'pattern': {'Regex': PATTERN}, 'behavior': 'Isolated', 'invert': False}


def _splits_as_gpt2(pre) -> bool:
    """Whether a tokenizer.json's pre_tokenizer makes GPT-2's pieces and bytes: ByteLevel with its own regex
    (GPT-2's), alone or alone in a Sequence; or a Sequence of GPT2_SPLIT, then ByteLevel without a regex (the same
    split, spelled out). Either ByteLevel without a prefix space."""
    steps = pre.get('pretokenizers') if isinstance(pre, dict) and pre.get('type') == 'Sequence' else [pre]
    if not (isinstance(steps, list) and all(isinstance(step, dict) for step in steps)):
        return False
    if steps[:1] == [GPT2_SPLIT]:
        return len(steps) == 2 and _byte_level(steps[1], regex=False)
    return len(steps) == 1 and _byte_level(steps[0], regex=True)


def _byte_level(step: dict, *, regex: bool) -> bool:
    """Whether step is ByteLevel without a prefix space, splitting by its own regex or (regex False) not at all."""
    return step.get('type') == 'ByteLevel' and step.get('add_prefix_space') is False and \
        step.get('use_regex', True) is regex


STAGING = '.staging-'  # + mkdtemp's characters: a pair being written, beside the vocabularies' folders
STALE_S = 3600  # a staging this old was left by a writer killed mid-write: a live one takes well under a second


def _write_pair(folder: str, vocab: dict, merges: list) -> None:
    """vocab.json and merges.txt into folder, both or neither: written into a staging folder beside it, which is
    then renamed (where another process renamed the same bytes' pair in first, that one stays). The stagings
    of writers killed before the rename go first."""
    parent, staging = os.path.dirname(folder), None
    try:
        os.makedirs(parent, exist_ok=True)
        # Stagings of writers killed before the rename. Age, not the writer's pid (checkpoint.staged's rule), tells
        # them apart: the cache may be a home folder that other machines write too.
        remove_stale(parent, STAGING, STALE_S, holding=set(CACHED))
        staging = tempfile.mkdtemp(prefix=STAGING, dir=parent)
        with open(os.path.join(staging, CACHED[0]), 'w', encoding='utf-8') as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(os.path.join(staging, CACHED[1]), 'w', encoding='utf-8') as f:
            f.write('#version: 0.2\n' + ''.join(f'{a} {b}\n' for a, b in merges))
        os.replace(staging, folder)
    except OSError as e:
        if not os.path.isdir(folder):
            raise GPT2Error(f'cannot write {folder} ({e.strerror}): set {CACHE_ENV} to a folder that can be '
                            f'written') from None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)


@functools.lru_cache(maxsize=8)
def _cached_encoder(encoder_path: str, bpe_path: str, fast: Optional[bool]) -> Encoder:
    encoder, merges = _read_files(encoder_path, bpe_path)
    return Encoder(encoder, merges, fast=fast)


def well_formed(text: str) -> str:
    """text with each lone surrogate (what undecodable bytes become in a str) as U+FFFD, as tiktoken takes it."""
    try:
        text.encode('utf-8')
        return text
    except UnicodeEncodeError:
        return text.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')


def get_encoder(model_dir: Optional[str | os.PathLike] = None, *, fast: Optional[bool] = None) -> Encoder:
    """The encoder of a model folder (its encoder.json and vocab.bpe), or the bundled GPT-2 one."""
    if model_dir is None:
        encoder_path, bpe_path = bundled_vocabulary()
    else:
        encoder_path = os.path.join(os.fspath(model_dir), 'encoder.json')
        bpe_path = os.path.join(os.fspath(model_dir), 'vocab.bpe')
    return _cached_encoder(os.path.abspath(encoder_path), os.path.abspath(bpe_path), fast)


def encoder_for(model_dir: str | os.PathLike) -> Encoder:
    """The model folder's own vocabulary when it has one, else the bundled GPT-2 files.

    The original layout names the files encoder.json and vocab.bpe; a Hugging Face
    folder names the same files vocab.json and merges.txt, or (transformers 5) holds
    only a tokenizer.json, read when it is GPT-2's kind of tokenizer (_tokenizer_pair).
    Added tokens (an added_tokens.json, or a tokenizer.json with added tokens beyond
    <|endoftext|>) and another kind of tokenizer.json are refused: the model itself
    still loads.
    """
    model_dir = folder_of(os.fspath(model_dir))
    has = lambda name: os.path.exists(os.path.join(model_dir, name))  # noqa: E731
    files = vocabulary_files(model_dir)
    if files and files[0].endswith('encoder.json'):
        return get_encoder(model_dir)
    if has('added_tokens.json') or _added_tokens(os.path.join(model_dir, TOKENIZER_JSON)):
        raise GPT2Error(f'{model_dir}: the vocabulary has added tokens, which this tokenizer does not read; '
                        f'the model loads, but encode text with the folder\'s own tokenizer')
    if not files and has(TOKENIZER_JSON):  # vocabulary_files passed it over: this raises, saying what differs
        files = _tokenizer_pair(os.path.join(model_dir, TOKENIZER_JSON))
    return _cached_encoder(*map(os.path.abspath, files), None) if files else get_encoder()


def folder_of(path: str) -> str:
    """The folder a checkpoint prefix's save sits in (checkpoint/run1/model-2 -> checkpoint/run1); a folder
    as it is: where its vocabulary is."""
    return (os.path.dirname(path) or '.') if is_save(path) else path


def is_save(path: str) -> bool:
    """Whether path names one save of a folder by its prefix (model-2 beside model-2.index), not a folder."""
    return os.path.isfile(path + '.index') and not os.path.isdir(path)


def vocabulary_files(model_dir: str | os.PathLike) -> Optional[tuple]:
    """A folder's (encoder.json, vocab.bpe), or HF's (vocab.json, merges.txt) when it has either of those
    but not the first pair, or else the pair its tokenizer.json holds when that is GPT-2's kind (_tokenizer_pair);
    None when it has none of these (another kind of tokenizer.json: encoder_for says why). One file of a pair
    without the other is refused."""
    model_dir = folder_of(os.fspath(model_dir))
    for names in (('encoder.json', 'vocab.bpe'), ('vocab.json', 'merges.txt')):
        paths = tuple(os.path.join(os.fspath(model_dir), name) for name in names)
        there = [os.path.exists(p) for p in paths]
        if all(there):
            return paths
        if any(there):
            have, missing = (names[0], names[1]) if there[0] else (names[1], names[0])
            raise VocabularyNotFound(f'{os.fspath(model_dir)} has {have} but not {missing}: copy both files of '
                                     f'the vocabulary in (or neither, for the bundled GPT-2 one)')
    tokenizer = os.path.join(model_dir, TOKENIZER_JSON)
    with contextlib.suppress(GPT2Error):  # refused where text is read (encoder_for); a token file trains without
        return _tokenizer_pair(tokenizer) if os.path.exists(tokenizer) else None
    return None


PAIR = 'encoder.json and vocab.bpe, or vocab.json and merges.txt'  # what a written folder carries of a vocabulary


def carried_vocabulary(model_dir: Optional[str | os.PathLike], n_vocab: int, files: Optional[tuple] = None) -> tuple:
    """The vocabulary files a model carries into a folder written from it (save_hf, export_litert, the command
    line's convert and export): files when given, else its folder's own pair under either naming (or the one its
    GPT-2 tokenizer.json holds), else the bundled GPT-2 pair (model_dir None: a model load_model did not read).
    Refused, not replaced: a vocabulary the pair cannot hold (added tokens, another kind of tokenizer.json), and
    one of more tokens than the model's n_vocab (its ids past the model's would fail in any reader of the written
    folder)."""
    if files is None and model_dir is not None:
        try:
            encoder = encoder_for(model_dir)  # the rules by which the folder's text is read
            files = vocabulary_files(model_dir) or bundled_vocabulary()
        except GPT2Error as e:
            raise GPT2Error(f'{first_line(e)} (a written folder carries only the vocabulary pair: {PAIR})') from None
    else:
        if files is not None and (isinstance(files, (str, bytes, os.PathLike)) or len(files) != 2):
            raise GPT2Error(f'vocabulary= takes a pair of paths ({PAIR}), got {files!r}')
        files = files or bundled_vocabulary()
        encoder = _cached_encoder(*map(os.path.abspath, files), None)
    if encoder.n_vocab > n_vocab:
        raise GPT2Error(f'the vocabulary {files[0]} holds {encoder.n_vocab} tokens, more than the model\'s {n_vocab}: '
                        f'put the pair made for the model ({PAIR}) in its folder (in Python, or pass it as '
                        f'vocabulary=)')
    return files


def _added_tokens(path: str) -> list:
    """The added tokens of an HF tokenizer.json other than <|endoftext|>."""
    try:
        with open(path, encoding='utf-8') as f:
            tokenizer = json.load(f)
    except (OSError, ValueError):
        return []
    return [t for t in _added(tokenizer) if t.get('content') != END_OF_TEXT]


def _added(tokenizer) -> list:
    """The added tokens of a parsed tokenizer.json, each a JSON object."""
    added = (tokenizer.get('added_tokens') if isinstance(tokenizer, dict) else None) or []
    return [t for t in added if isinstance(t, dict)] if isinstance(added, list) else []


def encode(text: str, *, special: bool = False) -> list:
    """Token ids for text with the bundled GPT-2 vocabulary."""
    return get_encoder().encode(text, special=special)


def decode(tokens: Iterable[int]) -> str:
    """Text for token ids with the bundled GPT-2 vocabulary."""
    return get_encoder().decode(tokens)
