"""The byte-level BPE: the original's ids on every input, on both paths."""

import errno
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import sysconfig
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpt2_tf.assets import bundled_vocabulary as bundled_files
from gpt2_tf.encoder import (BLANK_RUN, CACHE_ENV, END_OF_TEXT, STALE_S, Encoder, _long_blank, bytes_to_unicode,
                             carried_vocabulary, encoder_for, get_encoder, vocabulary_files)
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES, require

CASES = [json.loads(line) for line in (FIXTURES / 'bpe-cases.jsonl').read_text(encoding='utf-8').split('\n') if line]
PATHS = {'python': get_encoder(fast=False), 'tiktoken': get_encoder(fast=True)}


def test_bundled_files_are_openais():
    encoder_json, vocab_bpe = bundled_files()
    with open(encoder_json, 'rb') as f:
        assert hashlib.sha256(f.read()).hexdigest() == '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783'
    with open(vocab_bpe, 'rb') as f:
        assert hashlib.sha256(f.read()).hexdigest() == '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5'


def test_backends():
    assert PATHS['python'].backend == 'python' and PATHS['tiktoken'].backend == 'tiktoken'
    assert get_encoder().backend == 'tiktoken'  # the default when tiktoken is installed
    assert PATHS['python'].n_vocab == 50257


@pytest.mark.parametrize('path', PATHS)
def test_decode_takes_integer_ids_only(path):
    assert PATHS[path].decode(np.array([15496, 995], np.int64)) == 'Hello world'
    for odd in ([1.7], [True], ['5']):
        with pytest.raises(GPT2Error, match='token ids are integers, got'):
            PATHS[path].decode(odd)


@pytest.mark.parametrize('text', ['\udcff', 'caf\udce9 au lait', '\ud83d\ude00 paired', 'x\ud800'])
def test_lone_surrogates_encode_as_the_replacement_character_on_both_paths(text):
    replaced = text.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')
    assert '\ufffd' in replaced or '\U0001f600' in replaced  # what tiktoken's own wrapper takes
    expected = PATHS['tiktoken']._tiktoken.encode_ordinary(replaced)  # tiktoken's core, on the replaced text
    assert PATHS['python'].encode(text) == PATHS['tiktoken'].encode(text) == expected


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('case', CASES, ids=lambda c: repr(c['text'][:20]))
def test_reference_ids(path, case):
    enc = PATHS[path]
    assert enc.encode(case['text']) == case['ids']
    assert enc.decode(case['ids']) == case['text']


def test_byte_table_is_a_bijection_onto_printables():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord('A')] == 'A' and table[ord(' ')] == 'Ġ' and table[ord('\n')] == 'Ċ'
    assert all(c.isprintable() and not c.isspace() for c in table.values())


@pytest.mark.parametrize('path', PATHS)
def test_end_of_text_is_text_unless_asked(path):
    enc = PATHS[path]
    text = f'a{END_OF_TEXT}b'
    assert 50256 not in enc.encode(text)
    assert enc.encode(text, special=True) == enc.encode('a') + [50256] + enc.encode('b')
    assert enc.decode([50256]) == END_OF_TEXT


def test_no_ignorecase_quirk_is_kept():
    # Lower-case contractions split off; upper-case ones do not, as in GPT-2's training.
    enc = PATHS['python']
    assert [enc.decode([t]) for t in enc.encode("it's IT'S")] == ['it', "'s", ' IT', "'", 'S']


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip(text):
    for enc in PATHS.values():
        assert enc.decode(enc.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec='utf-8'), max_size=60) | st.from_regex(r"[ a-zA-Z'\n\t0-9]{0,40}", fullmatch=True))
def test_paths_agree(text):
    assert PATHS['python'].encode(text) == PATHS['tiktoken'].encode(text)
    assert PATHS['python'].encode(text, special=True) == PATHS['tiktoken'].encode(text, special=True)


@pytest.mark.parametrize('blank', [' ', '\n', '\t', '\r\n', ' \n'])
def test_a_million_blanks_in_a_row_encode_as_the_original_does(blank, capfd):
    # tiktoken's regex engine panics on such a run (a Rust panic, not an Exception); the original's way takes it
    text = blank * 1_000_000 + 'x'
    ids = PATHS['tiktoken'].encode(text)
    assert ids == PATHS['python'].encode(text)
    short = PATHS['tiktoken'].encode(blank * 1000 + 'x')  # the same rule, where tiktoken takes it
    assert ids[:len(short) - 3] == short[:-3] and ids[-3:] == short[-3:]
    assert 'panicked' not in capfd.readouterr().err  # tiktoken was not asked: no Rust panic message


def test_invalid_utf8_decodes_with_replacement():
    half = PATHS['python'].encoder[bytes_to_unicode()[0xC3]]  # the first byte of a two-byte character
    for enc in PATHS.values():
        assert enc.decode([half]) == '\ufffd'


@pytest.mark.parametrize('path', PATHS)
def test_decoding_an_unknown_id_is_an_error(path):
    with pytest.raises(ValueError, match=r'token id 50257 is outside the vocabulary \[0, 50257\), which has no text '
                                         r'for it \(a model of a larger n_vocab draws such ids: give it the '
                                         r'vocabulary made for it\)$'):
        PATHS[path].decode([1, 50257])
    with pytest.raises(ValueError, match='token id -1'):
        PATHS[path].decode([-1])


@pytest.fixture
def vocab_dir(tmp_path):
    for f in bundled_files():
        shutil.copy(f, tmp_path)
    return tmp_path


def test_model_folder_files_are_used(vocab_dir):
    enc = get_encoder(vocab_dir)
    assert enc.encode('Hello world') == [15496, 995]


@pytest.mark.parametrize('name, content, message', [
    ('encoder.json', None, 'no encoder.json at .*encoder.json'),
    ('vocab.bpe', None, 'no vocab.bpe at .*vocab.bpe'),
    ('encoder.json', '{"a": ', r'encoder.json: not valid JSON'),
    ('encoder.json', '["a"]', r'encoder.json: expected a JSON object'),
    ('encoder.json', '{"a": 0, "b": 2}', r'encoder.json: ids must be 0 .. 1, each once'),
    ('vocab.bpe', 'Ġ t\n', r'vocab.bpe: expected a "#version" header line'),
    ('vocab.bpe', '#version: 0.2\nĠ t x\n', r'vocab.bpe, line 2: expected two symbols'),
    ('vocab.bpe', '#version: 0.2\nq zzz\n', r"vocab.bpe, line 2: merge 'q zzz' makes a token missing from encoder.json"),
])
def test_bad_files_name_the_file(vocab_dir, name, content, message):
    if content is None:
        (vocab_dir / name).unlink()
    else:
        (vocab_dir / name).write_text(content, encoding='utf-8')
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        get_encoder(vocab_dir)


def test_custom_vocabulary_falls_back_to_python():
    encoder = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    encoder['ab'] = 256
    encoder['Ġab'] = 257
    enc = Encoder(encoder, [('a', 'b'), ('Ġ', 'ab')])
    assert enc.encode('ab ab') == [256, 257] and enc.backend == 'python'
    swapped = dict(encoder, ab=257, Ġab=256)
    assert Encoder(swapped, [('a', 'b'), ('Ġ', 'ab')]).backend == 'python'


def test_a_vocabulary_where_tiktoken_would_merge_differently_uses_the_original_algorithm():
    # Merge ids are 256 + rank, yet tiktoken (merging by the merged token's rank) would turn
    # 'abc' into the one token 'abc', where merging by pair rank stops at 'ab', 'c'.
    encoder = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    encoder.update(ab=256, bc=257, abc=258)
    enc = Encoder(encoder, [('a', 'b'), ('b', 'c'), ('a', 'bc')])
    assert enc.backend == 'python'
    assert enc.encode('abc') == [256, encoder['c']]
    with pytest.raises(ValueError, match="needs tiktoken installed and GPT-2's own vocabulary"):
        Encoder(encoder, [('a', 'b'), ('b', 'c'), ('a', 'bc')], fast=True)


def original_bpe(word: str, ranks: dict) -> list:
    """openai/gpt-2's bpe, transcribed: the pair of lowest rank, merged wherever it stands, left to right and
    without overlap; again, until no pair has a rank."""
    word = list(word)
    while len(word) > 1:
        first, second = min(zip(word, word[1:]), key=lambda pair: ranks.get(pair, float('inf')))
        if (first, second) not in ranks:
            break
        merged, i = [], 0
        while i < len(word):
            if word[i:i + 2] == [first, second]:
                merged.append(first + second)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return word


def random_merges(rng: random.Random) -> list:
    """Merges over one to three letters, each joining two symbols made before it, so that two merges may make
    the same symbol ('a bc', 'ab c'), a merge may join a symbol to itself ('a a': overlapping runs) and most
    pairs have no merge; half the time shuffled, so a merge may rank before those that make its parts (a
    round's merges then make a pair of a lower rank than its own)."""
    symbols = list('abc'[:rng.randint(1, 3)])
    merges = []
    for _ in range(rng.randint(0, 12)):
        pair = rng.choice(symbols), rng.choice(symbols)
        merges.append(pair)
        symbols.append(''.join(pair))
    if rng.random() < 0.5:
        rng.shuffle(merges)
    return merges


@pytest.mark.parametrize('word, merges, symbols', [
    ('aaa', [('a', 'a')], ['aa', 'a']),  # overlapping places: the leftmost first
    ('aaaaa', [('a', 'a'), ('aa', 'a')], ['aa', 'aaa']),  # every place of a round, then the next rank
    ('abab', [('ab', 'a'), ('a', 'b')], ['ab', 'ab']),  # ... even those of a lower rank that it makes
    ('abc', [('a', 'b'), ('b', 'c'), ('a', 'bc')], ['ab', 'c']),
    ('abc', [('b', 'c'), ('ab', 'c'), ('a', 'bc')], ['abc']),  # 'abc' made two ways
    ('', [('a', 'b')], []),
])
def test_bpe_merges_as_the_original_on_known_cases(word, merges, symbols):
    assert original_bpe(word, {pair: rank for rank, pair in enumerate(merges)}) == symbols  # the reference itself
    assert Encoder({}, merges, fast=False).bpe(word) == ' '.join(symbols)


@pytest.mark.parametrize('seed', range(4))
def test_bpe_merges_as_the_original_on_random_tables(seed):
    rng = random.Random(seed)
    for _ in range(250):
        merges = random_merges(rng)
        enc, ranks = Encoder({}, merges, fast=False), {pair: rank for rank, pair in enumerate(merges)}
        for _ in range(20):
            word = ''.join(rng.choice('abc') for _ in range(rng.randint(1, 16)))
            assert enc.bpe(word).split(' ') == original_bpe(word, ranks), (word, merges)


def stdlib_text() -> str:
    """Real text: three of Python's own modules, in every installation."""
    stdlib = pathlib.Path(sysconfig.get_paths()['stdlib'])
    return ''.join((stdlib / name).read_text(encoding='utf-8') for name in ('argparse.py', 'difflib.py', 'textwrap.py'))


def test_the_python_path_gives_tiktokens_ids_on_real_words_and_long_pieces():
    python = Encoder(*bundled_tables(), fast=False)  # its own cache: every word goes through bpe
    text = stdlib_text()
    words = sorted(set(python.pat.findall(text)))
    assert len(words) > 3000
    letters = ''.join(word.strip() for word in words if word.strip().isalpha())
    marks = ''.join(c for c in text if not (c.isalnum() or c.isspace()))
    long = [letters[i:i + 5000] for i in range(0, 20000, 5000)] + [marks[:5000]]
    assert all(python.pat.fullmatch(piece) for piece in long)  # each one piece for bpe
    assert [python.encode(word) for word in words] == [PATHS['tiktoken'].encode(word) for word in words]
    assert [python.encode(piece) for piece in long] == [PATHS['tiktoken'].encode(piece) for piece in long]


class CountedRanks(dict):
    """A merge table that counts the ranks looked up in it."""
    lookups = 0

    def get(self, pair, default=None):
        self.lookups += 1
        return super().get(pair, default)

    def __getitem__(self, pair):
        self.lookups += 1
        return super().__getitem__(pair)

    def __contains__(self, pair):
        self.lookups += 1
        return super().__contains__(pair)


def test_a_long_piece_costs_a_few_rank_lookups_per_character():
    # Counted, not timed: the original looks up every pair each round, 8e6 lookups for these 20,000 letters
    # (7 s). Each merge here pushes at most two pairs and each pair is looked up once or twice when pushed and
    # once when popped: about 3 per character here, and at most 7 whatever the vocabulary.
    enc = Encoder(*bundled_tables(), fast=False)
    enc.bpe_ranks = CountedRanks(enc.bpe_ranks)
    rng = random.Random(0)
    piece = ''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(20000))
    assert len(enc.encode(piece)) > 10000
    lookups = enc.bpe_ranks.lookups
    assert 0 < lookups <= 7 * len(piece)


@pytest.mark.parametrize('blank', ['\u2003', '\x0c', ' \t\n'])
def test_a_run_of_any_whitespace_past_tiktokens_limit_is_encoded_without_its_panic(blank, capfd):
    # tiktoken panics at about 10^6 characters of any whitespace; the original's way takes such a run, silently
    text = blank * (1_000_000 // len(blank)) + 'x'
    assert PATHS['tiktoken'].encode(text) == PATHS['python'].encode(text)
    assert 'panicked' not in capfd.readouterr().err


@pytest.mark.parametrize('before', [0, 1, BLANK_RUN // 2 - 1, 12345])
def test_every_whitespace_run_of_blank_run_characters_is_found(before):
    mixed = ''.join(' \t\n\r\x0b\x0c\xa0\u2003\u3000\u2028'[i % 10] for i in range(BLANK_RUN))  # Python's \s, mixed
    assert _long_blank('a' * before + mixed + 'b')
    assert _long_blank('\u2003' * BLANK_RUN)
    assert not _long_blank(('a' + ' ' * (BLANK_RUN // 2 - 1)) * 5)  # shorter runs, past no whole block
    assert not _long_blank('a' * BLANK_RUN * 3)


def read_tables(encoder_path, bpe_path) -> tuple:
    """A vocabulary pair's (encoder, merges) as plain JSON and line splitting read them, not the code under test."""
    with open(encoder_path, encoding='utf-8') as f, open(bpe_path, encoding='utf-8') as g:
        return json.load(f), [tuple(line.split()) for line in g.read().split('\n')[1:] if line]


def bundled_tables() -> tuple:
    return read_tables(*bundled_files())


def _without_z(vocab_dir):
    """vocab_dir's encoder.json with the byte symbol 'z' renamed to a token no byte makes alone."""
    encoder, _ = bundled_tables()
    encoder['zzzzzzzzzzzzzzzz'] = encoder.pop('z')
    (vocab_dir / 'encoder.json').write_text(json.dumps(encoder), encoding='utf-8')


@pytest.mark.parametrize('change, message', [
    (_without_z, r"encoder.json: no token for byte 0x7a \('z'\); a byte-level BPE vocabulary has all 256"),
    (lambda d: (d / 'encoder.json').write_text(json.dumps({**bundled_tables()[0], 'two words': 50257})),
     r"encoder.json: token 'two words' holds ' ', which stands for no byte"),
])
def test_a_vocabulary_that_is_not_byte_level_is_refused_as_it_is_read(vocab_dir, change, message):
    change(vocab_dir)
    with pytest.raises(GPT2Error, match=message) as refused:
        get_encoder(vocab_dir)
    assert '\n' not in str(refused.value)


def test_special_needs_end_of_text_in_the_vocabulary():
    enc = Encoder({c: i for i, c in enumerate(bytes_to_unicode().values())}, [])
    assert enc.encode(f'a{END_OF_TEXT}') == enc.encode('a<|endoftext|>')  # text, as without special
    assert enc.encode('ab', special=True) == enc.encode('ab')  # nothing special in it: no need of the token
    with pytest.raises(GPT2Error, match=r'^special=True reads <\|endoftext\|>, which this vocabulary does not have: '
                                        r'encode with special=False, where it is text$'):
        enc.encode(f'a{END_OF_TEXT}b', special=True)


def test_a_vocabulary_larger_than_the_model_names_the_way_for_each_caller():
    with pytest.raises(GPT2Error, match=r'in its folder \(in Python, or pass it as vocabulary=\)$'):
        carried_vocabulary(None, 1000, bundled_files())


@pytest.mark.parametrize('given', ['encoder.json', ('encoder.json',), ('a', 'b', 'c')])
def test_a_vocabulary_that_is_not_a_pair_of_paths_is_refused(given):
    with pytest.raises(GPT2Error, match=r'^vocabulary= takes a pair of paths \(encoder.json and vocab.bpe, or '):
        carried_vocabulary(None, 50257, given)  # save_hf(model, out, vocabulary='encoder.json'): a TypeError


# --- a tokenizer.json alone (what transformers 5 saves) ----------------------------------------------------

@pytest.fixture(scope='module')
def saved_tokenizer(tmp_path_factory) -> dict:
    """The tokenizer.json transformers saves for GPT-2's vocabulary (GPT2TokenizerFast from vocab.json and
    merges.txt, then save_pretrained), parsed."""
    transformers = require('transformers')
    pair, saved = tmp_path_factory.mktemp('pair'), tmp_path_factory.mktemp('saved')
    for name, path in zip(('vocab.json', 'merges.txt'), bundled_files()):
        shutil.copy(path, pair / name)
    transformers.GPT2TokenizerFast.from_pretrained(pair).save_pretrained(saved)
    return json.loads((saved / 'tokenizer.json').read_text(encoding='utf-8'))


@pytest.fixture
def tokenizer_folder(tmp_path, monkeypatch, saved_tokenizer):
    """write(tokenizer) -> a folder holding only that tokenizer.json; the derived pairs go under tmp_path."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'cache'))

    def write(tokenizer: dict, name: str = 'folder'):
        (tmp_path / name).mkdir()
        (tmp_path / name / 'tokenizer.json').write_text(json.dumps(tokenizer), encoding='utf-8')
        return tmp_path / name
    return write


def tiktoken_gpt2():
    """tiktoken's own gpt2 encoding (tiktoken_ext.openai_public's recipe), from the bundled files it checks by hash."""
    tiktoken = require('tiktoken')
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder_json, vocab_bpe = bundled_files()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe, encoder_json,
        vocab_bpe_hash='1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
        encoder_json_hash='196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783')
    return tiktoken.Encoding('gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={END_OF_TEXT: 50256}, explicit_n_vocab=50257)


def as_strings(tokenizer: dict) -> dict:
    """tokenizer with its merges as older tokenizers versions wrote them: "a b" strings, not pairs."""
    merges = [m if isinstance(m, str) else ' '.join(m) for m in tokenizer['model']['merges']]
    return {**tokenizer, 'model': {**tokenizer['model'], 'merges': merges}}


def in_sequence(tokenizer: dict) -> dict:
    return {**tokenizer, 'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [tokenizer['pre_tokenizer']]}}


def untyped(tokenizer: dict) -> dict:
    """tokenizer as older tokenizers versions wrote it: the model without its type, the pre-tokenizer without
    use_regex (both their defaults, BPE and true)."""
    pre = {k: v for k, v in tokenizer['pre_tokenizer'].items() if k != 'use_regex'}
    model = {k: v for k, v in as_strings(tokenizer)['model'].items() if k != 'type'}
    return {**tokenizer, 'model': model, 'pre_tokenizer': pre}


# openai/gpt-2 src/encoder.py's regex, as written there
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def spelled_out(tokenizer: dict, pattern: str = GPT2_REGEX, *, literal: bool = False, **split) -> dict:
    """tokenizer with its split spelled out, as the tokenizers library writes Sequence([Split(Regex(pattern),
    behavior='isolated', **split), ByteLevel(add_prefix_space=False, use_regex=False)]); literal: the pattern
    as a string to split at, not a Regex."""
    tokenizers = require('tokenizers')
    pre = tokenizers.pre_tokenizers
    holder = tokenizers.Tokenizer(tokenizers.models.BPE())
    holder.pre_tokenizer = pre.Sequence([
        pre.Split(pattern if literal else tokenizers.Regex(pattern), **{'behavior': 'isolated', **split}),
        pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    return {**tokenizer, 'pre_tokenizer': json.loads(holder.to_str())['pre_tokenizer']}


@pytest.mark.parametrize('form', [lambda t: t, as_strings, in_sequence, untyped, spelled_out],
                         ids=['pairs', 'strings', 'sequence', 'untyped', 'spelled-out'])
def test_a_gpt2_tokenizer_json_alone_is_read_as_its_vocabulary(tokenizer_folder, saved_tokenizer, monkeypatch,
                                                                form):
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', '')  # tiktoken reads the bundled files, copying them nowhere
    folder = tokenizer_folder(form(saved_tokenizer))
    assert read_tables(*vocabulary_files(folder)) == bundled_tables()
    enc, reference = encoder_for(folder), tiktoken_gpt2()
    texts = [case['text'] for case in CASES] + ["Hello world, it's 2024!\n\n\tcafé 日本 🙂", stdlib_text()[:20000]]
    assert [enc.encode(text) for text in texts] == [reference.encode_ordinary(text) for text in texts]
    theirs = require('transformers').PreTrainedTokenizerFast(tokenizer_file=str(folder / 'tokenizer.json'))
    ordinary = [text for text in texts if END_OF_TEXT not in text]  # HF reads it as the special token
    assert [enc.encode(text) for text in ordinary] == [theirs.encode(text) for text in ordinary]
    own = require('tokenizers').Tokenizer.from_file(str(folder / 'tokenizer.json'))  # the library alone
    assert [enc.encode(text) for text in ordinary] == [encoding.ids for encoding in own.encode_batch(ordinary)]
    assert encoder_for(folder).encode('zebra') == [89, 37052]  # the second time from the cached pair


def _drop_end_of_text(tokenizer: dict) -> dict:
    vocab = dict(tokenizer['model']['vocab'])
    del vocab[END_OF_TEXT]
    return {**tokenizer, 'model': {**tokenizer['model'], 'vocab': vocab}}


@pytest.mark.parametrize('change, differs', [
    pytest.param(lambda t: {}, 'model is not a BPE with a vocab and merges (type None)', id='empty'),
    pytest.param(lambda t: {**t, 'model': {**t['model'], 'type': 'WordPiece'}},
                 "model is not a BPE with a vocab and merges (type 'WordPiece')", id='wordpiece'),
    pytest.param(lambda t: {**t, 'model': {**t['model'], 'ignore_merges': True}}, 'BPE model sets ignore_merges=True',
                 id='ignore-merges'),
    pytest.param(lambda t: {**t, 'model': {**t['model'], 'merges': [[1, 2]]}},
                 'model.merges holds an entry other than', id='merge-of-numbers'),
    pytest.param(lambda t: {**t, 'normalizer': {'type': 'NFC'}}, 'normalizer changes the text first', id='normalizer'),
    pytest.param(lambda t: {**t, 'pre_tokenizer': {**t['pre_tokenizer'], 'add_prefix_space': True}},
                 'pre-tokenizer is not', id='prefix-space'),
    pytest.param(lambda t: {**t, 'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
        t['pre_tokenizer'], {'type': 'Digits', 'individual_digits': True}]}}, 'pre-tokenizer is not', id='digits'),
    pytest.param(_drop_end_of_text, '<|endoftext|> is an added token at id 50256, not its model.vocab id',
                 id='end-of-text-added'),
    pytest.param(lambda t: spelled_out(t, f'(?i:{GPT2_REGEX})'), 'pre-tokenizer is not', id='split-ignorecase'),
    pytest.param(lambda t: spelled_out(t, literal=True), 'pre-tokenizer is not', id='split-at-a-string'),
    pytest.param(lambda t: spelled_out(t, behavior='contiguous'), 'pre-tokenizer is not', id='split-contiguous'),
    pytest.param(lambda t: spelled_out(t, invert=True), 'pre-tokenizer is not', id='split-inverted'),
])
def test_another_kind_of_tokenizer_json_is_refused_saying_what_differs(tokenizer_folder, saved_tokenizer, change,
                                                                        differs):
    folder = tokenizer_folder(change(saved_tokenizer))
    assert vocabulary_files(folder) is None  # a token file trains without it
    with pytest.raises(GPT2Error) as refused:
        encoder_for(folder)
    assert str(refused.value).startswith(f'{folder} has only a tokenizer.json, and its {differs}')
    assert '\n' not in str(refused.value)


def test_a_tokenizer_json_vocabulary_that_is_not_byte_level_names_the_file(tokenizer_folder, saved_tokenizer):
    vocab = dict(saved_tokenizer['model']['vocab'])
    vocab['zzzzzzzzzzzzzzzz'] = vocab.pop('z')
    folder = tokenizer_folder({**saved_tokenizer, 'model': {**saved_tokenizer['model'], 'vocab': vocab}})
    with pytest.raises(GPT2Error, match=r"tokenizer.json \(model.vocab\): no token for byte 0x7a \('z'\)"):
        encoder_for(folder)


def test_the_pair_a_tokenizer_json_holds_is_written_whole_or_not_at_all(tokenizer_folder, saved_tokenizer, tmp_path,
                                                                         monkeypatch):
    import gpt2_tf.encoder

    folder = tokenizer_folder(saved_tokenizer)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, 'No space left on device')
    with monkeypatch.context() as patched:
        patched.setattr(gpt2_tf.encoder.json, 'dump', full)
        with pytest.raises(GPT2Error, match=rf'^cannot write {re.escape(str(tmp_path / "cache"))}/\w{{16}} \(No '
                                            rf'space left on device\): set {CACHE_ENV} to a folder that can be '
                                            rf'written$'):
            encoder_for(folder)
    assert os.listdir(tmp_path / 'cache') == []  # no pair, and no staging folder left
    assert encoder_for(folder).n_vocab == 50257
    [written] = os.listdir(tmp_path / 'cache')
    assert sorted(os.listdir(tmp_path / 'cache' / written)) == ['merges.txt', 'vocab.json']
    (tmp_path / 'file').write_text('')
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'file' / 'cache'))
    with pytest.raises(GPT2Error, match=rf'^cannot write .*: set {CACHE_ENV} to a folder that can be written$'):
        encoder_for(folder)


def test_a_killed_writers_staging_goes_at_the_next_write_and_a_live_ones_stays(tokenizer_folder, saved_tokenizer,
                                                                                 tmp_path):
    cache = tmp_path / 'cache'
    killed, live, pair = cache / '.staging-killed00', cache / '.staging-running', cache / '0123456789abcdef'
    others = cache / '.staging-build'  # another program's, in a cache folder shared with it
    for folder, age in (killed, STALE_S + 60), (live, STALE_S / 2), (pair, STALE_S * 24), (others, STALE_S * 24):
        folder.mkdir(parents=True)  # ages in seconds
        (folder / 'vocab.json').write_text('{')
        os.utime(folder, (time.time() - age,) * 2)
    (others / 'notes.txt').write_text('theirs')
    os.utime(others, (time.time() - STALE_S * 24,) * 2)
    encoder_for(tokenizer_folder(saved_tokenizer))  # a pair not there yet: written
    written = [name for name in os.listdir(cache) if re.fullmatch(r'[0-9a-f]{16}', name) and name != pair.name]
    assert sorted(os.listdir(cache)) == sorted([live.name, pair.name, others.name, *written]) and len(written) == 1
