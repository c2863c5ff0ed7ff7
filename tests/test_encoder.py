"""The byte-level BPE: the original's ids on every input, on both paths."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gpt2_tf.assets import bundled_vocabulary as bundled_files
from gpt2_tf.encoder import END_OF_TEXT, Encoder, bytes_to_unicode, get_encoder
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES

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
    with pytest.raises(ValueError, match=r'token id 50257 is outside the vocabulary \[0, 50257\)'):
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
