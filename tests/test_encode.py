"""`gpt2-tf encode`: text to a token file (.bin) or to gpt-2-simple's chunks (.npz), through the command line."""

import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from gpt2_tf import corpus
from gpt2_tf.encoder import get_encoder

from test_corpus import MIXED, as_read

END = 50256
ENCODE = [sys.executable, '-m', 'gpt2_tf.cli', 'encode']
ROOT = pathlib.Path(__file__).parent.parent


def encode(tmp_path, *argv, stdin=None):
    return subprocess.run([*ENCODE, *map(str, argv)], cwd=tmp_path, input=stdin, capture_output=True, text=True,
                          timeout=300)


def ids_of(*texts):
    """The encoder on each whole text as a text file reads it (as_read), each followed by <|endoftext|>."""
    encoder = get_encoder()
    return [i for text in texts for i in encoder.encode(as_read(text)) + [END]]


@pytest.fixture
def texts(tmp_path):
    (tmp_path / 'docs' / 'deeper').mkdir(parents=True)
    files = {'docs/b.txt': 'Second file.\r\nWith a CRLF line.\n', 'docs/a.txt': MIXED,
             'docs/deeper/c.txt': 'Third, one folder down.', 'docs/notes.md': '# Markdown, skipped unless --glob'}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding='utf-8', newline='')
    return files


@pytest.mark.parametrize('processes', ['1', '2'])
def test_a_folder_becomes_a_token_file_in_sorted_path_order(tmp_path, texts, processes):
    done = encode(tmp_path, 'docs', 'train.bin', '--processes', processes)
    assert done.returncode == 0, done.stderr
    expected = ids_of(texts['docs/a.txt'], texts['docs/b.txt'], texts['docs/deeper/c.txt'])
    assert np.fromfile(tmp_path / 'train.bin', '<u2').tolist() == expected
    assert done.stdout.strip() == f'train.bin: {len(expected):,} tokens, 3 documents'
    assert 'tokens/s' not in done.stderr  # no progress bar when standard error is not a terminal
    assert sorted(os.listdir(tmp_path)) == ['docs', 'train.bin', 'train.bin.json']


def test_several_inputs_a_glob_and_standard_input(tmp_path, texts):
    done = encode(tmp_path, 'docs/deeper/c.txt', 'docs', 'md.bin', '--glob', '*.md')
    assert done.returncode == 0, done.stderr
    assert np.fromfile(tmp_path / 'md.bin', '<u2').tolist() == ids_of(texts['docs/deeper/c.txt'],
                                                                       texts['docs/notes.md'])
    done = encode(tmp_path, '-', 'stdin.bin', stdin=MIXED)
    assert done.returncode == 0, done.stderr
    assert np.fromfile(tmp_path / 'stdin.bin', '<u2').tolist() == ids_of(MIXED)


def test_an_npz_is_gpt2_simples_chunks_as_before(tmp_path):
    (tmp_path / 'corpus.txt').write_text('First document.\n<|endoftext|>\nSecond one.\n')
    done = encode(tmp_path, 'corpus.txt', 'out.npz', '--combine', '1')  # the old call: one chunk a document
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / 'out.npz') as npz:
        chunks = [npz[name].tolist() for name in npz.files]
    assert chunks == [ids_of('First document.'), ids_of('Second one.')]
    assert sorted(os.listdir(tmp_path)) == ['corpus.txt', 'out.npz']


def test_a_failed_encode_leaves_no_output(tmp_path, texts):
    (tmp_path / 'docs' / 'z.txt').write_bytes(b'caf\xe9 in latin-1')  # the last file: after the others are written
    done = encode(tmp_path, 'docs', 'train.bin', '--processes', '2')
    assert done.returncode == 2 and 'z.txt: not UTF-8 text' in done.stderr.splitlines()[-1]
    assert sorted(os.listdir(tmp_path)) == ['docs']
    done = encode(tmp_path, 'docs', 'train.txt')
    assert done.returncode == 2 and 'must end in .bin (a token file) or .npz' in done.stderr
    assert sorted(os.listdir(tmp_path)) == ['docs']


def test_the_progress_bar_counts_bytes_and_tokens_on_a_terminal(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    (tmp_path / 'a.txt').write_text('héllo ' * 2000, encoding='utf-8')
    screen = Terminal()
    progress, close = corpus.terminal_progress([tmp_path], stream=screen)
    corpus.encode_corpus([tmp_path], tmp_path / 'out.bin', piece=1000, progress=progress)
    close()
    last = screen.getvalue().split('\r')[-1]
    tokens = len(ids_of('héllo ' * 2000))
    assert '100%' in last and '14.0k/14.0k' in last and 'B/s' in last, last  # 7 bytes a word, in bytes
    assert f'{tokens:,} tokens, ' in last and 'tokens/s' in last, last
    assert corpus.terminal_progress([tmp_path], stream=io.StringIO())[0] is None
    (tmp_path / 'b.txt').write_bytes(b'\n\nline one\r\nline two\r\n' * 100)  # read as fewer bytes than the file's
    screen = Terminal()
    progress, close = corpus.terminal_progress([tmp_path / 'b.txt'], stream=screen)
    corpus.encode_corpus([tmp_path / 'b.txt'], tmp_path / 'b.bin', progress=progress)
    close(True)  # a finished run's bar is full
    assert '100%' in screen.getvalue().split('\r')[-1], screen.getvalue().split('\r')[-1]


def test_text_and_a_token_file_read_the_same_documents_and_a_csv_as_gpt2_simple(tmp_path):
    from gpt2_tf.dataset import load_dataset

    (tmp_path / 'd').mkdir()
    (tmp_path / 'd' / 'a.txt').write_bytes(b'\n\nHello world.\r\nSecond line.\r\n')  # CRLF, breaks at both ends
    (tmp_path / 'd' / 'b.txt').write_bytes(b'Old Mac\rline.\n<|endoftext|>\r\nNext document.')
    (tmp_path / 'd' / 'c.csv').write_bytes(b'text,label\r\n"Hello, world",1\r\n"Two\r\nlines",0\r\n,2\r\n')
    documents = ['Hello world.\nSecond line.', 'Old Mac\nline.', 'Next document.',
                 '<|startoftext|>Hello, world', '<|startoftext|>Two\nlines']  # the csv: header and empty row skipped
    by_hand = ids_of(*documents)
    done = encode(tmp_path, 'd', 'all.bin', '--glob', '*.*')
    assert done.returncode == 0, done.stderr
    assert np.fromfile(tmp_path / 'all.bin', '<u2').tolist() == by_hand
    chunks = load_dataset(str(tmp_path / 'd'), get_encoder(), combine=1)  # finetune's text path: one chunk each
    assert [i for chunk in chunks for i in chunk.tolist()] == by_hand
    done = encode(tmp_path, 'd', 'csv.npz', '--glob', '*.csv', '--combine', '1')  # the glob is an .npz's too
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / 'csv.npz') as npz:
        assert [npz[name].tolist() for name in npz.files] == [ids_of(d) for d in documents[3:]]


def test_encode_takes_a_model_folders_vocabulary(tmp_path):
    import shutil

    from gpt2_tf.encoder import Encoder, bytes_to_unicode

    (tmp_path / 'bytes').mkdir()  # a vocabulary of the 256 bytes and <|endoftext|>: one id per byte
    table = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    (tmp_path / 'bytes' / 'encoder.json').write_text(json.dumps({**table, '<|endoftext|>': 256}))
    (tmp_path / 'bytes' / 'vocab.bpe').write_text('#version: 0.2\n')
    (tmp_path / 'a.txt').write_text('hé')
    done = encode(tmp_path, 'a.txt', 'a.bin', '--model_dir', 'bytes')
    assert done.returncode == 0, done.stderr
    utf8 = list('hé'.encode())
    assert np.fromfile(tmp_path / 'a.bin', '<u2').tolist() == [table[bytes_to_unicode()[b]] for b in utf8] + [256]
    assert json.loads((tmp_path / 'a.bin.json').read_text())['n_vocab'] == 257
    shutil.rmtree(tmp_path / 'bytes')
    (tmp_path / 'bytes').mkdir()
    done = encode(tmp_path, 'a.txt', 'b.bin', '--model_dir', 'bytes')
    assert done.returncode == 2 and done.stderr.strip().endswith(
        'bytes has no vocabulary files (encoder.json and vocab.bpe, or vocab.json and merges.txt); leave out '
        '--model_dir to encode with the bundled GPT-2 vocabulary'), done.stderr


@pytest.mark.parametrize('argv, message', [
    (['a.txt', 'nodir/out.bin'], 'nodir is not a folder: create it first, or write out.bin elsewhere'),
    (['a.txt', 'out.npz', '--combine', '0'], 'combine must be an integer >= 1, got 0'),
    (['a.txt', 'out.bin', '--combine', '7'], 'combine is for an .npz (gpt-2-simple\'s chunks of text); a token file '
                                             'keeps each document whole: leave it out'),
    (['a.txt', 'out.npz', '--processes', '2'], 'processes is for a token file (.bin); an .npz is encoded in one '
                                               'process: leave it out'),
])
def test_bad_encode_arguments_are_one_line(tmp_path, argv, message):
    (tmp_path / 'a.txt').write_text('text')
    done = encode(tmp_path, *argv)
    assert done.returncode == 2 and done.stderr.strip().endswith(message), done.stderr
    assert sorted(os.listdir(tmp_path)) == ['a.txt']


def test_a_terminated_encode_leaves_no_partial_output(tmp_path):
    import signal
    import time

    process = subprocess.Popen([*ENCODE, '-', 'out.bin'], cwd=tmp_path, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdin.write(b'some text, and the pipe stays open\n')
    process.stdin.flush()
    deadline = time.monotonic() + 60
    while not (tmp_path / 'out.bin.partial').exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / 'out.bin.partial').exists()
    process.send_signal(signal.SIGTERM)  # a scheduler's stop, or `timeout`
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    process.stdin.close()
    process.stderr.close()
    assert os.listdir(tmp_path) == []


def test_the_encode_command_in_process_leaves_the_callers_sigterm_handler(tmp_path, monkeypatch):
    import signal

    from gpt2_tf.cli import main

    (tmp_path / 'a.txt').write_text('text')
    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(['encode', str(tmp_path / 'a.txt'), str(tmp_path / 'a.bin'), '--processes', '1']) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


END_MISSING = ('encoded text ends each document with <|endoftext|>, which this vocabulary does not have: add it to the '
               "vocabulary, or use one that has it (GPT-2's: without --model_dir)")


@pytest.mark.parametrize('out', ['o.bin', 'o.npz'])
def test_a_vocabulary_without_end_of_text_is_refused_in_one_line(tmp_path, out):
    from gpt2_tf.encoder import bytes_to_unicode

    (tmp_path / 'bytes').mkdir()  # the 256 bytes alone: no <|endoftext|> to end a document with
    table = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    (tmp_path / 'bytes' / 'encoder.json').write_text(json.dumps(table))
    (tmp_path / 'bytes' / 'vocab.bpe').write_text('#version: 0.2\n')
    (tmp_path / 'a.txt').write_text('Some text.')
    done = encode(tmp_path, 'a.txt', out, '--model_dir', 'bytes')
    assert done.returncode == 2 and done.stderr.strip() == f'gpt2-tf: error: {END_MISSING}', done.stderr
    assert sorted(os.listdir(tmp_path)) == ['a.txt', 'bytes']


def test_encode_reads_the_vocabulary_of_a_tokenizer_json_alone(tmp_path, monkeypatch):
    from conftest import require
    from gpt2_tf.assets import bundled_vocabulary
    from gpt2_tf.encoder import CACHE_ENV
    from gpt2_tf.hf import tokenizer_json

    require('tokenizers')
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / 'cache'))
    (tmp_path / 'hf').mkdir()
    tokenizer_json(*bundled_vocabulary(), str(tmp_path / 'hf' / 'tokenizer.json'))  # the one save_hf writes
    (tmp_path / 'a.txt').write_text(MIXED, encoding='utf-8', newline='')
    done = encode(tmp_path, 'a.txt', 'a.bin', '--model_dir', 'hf')
    assert done.returncode == 0, done.stderr
    assert np.fromfile(tmp_path / 'a.bin', '<u2').tolist() == ids_of(MIXED)
    assert json.loads((tmp_path / 'a.bin.json').read_text())['vocab_sha256'] == corpus.vocabulary_sha256(get_encoder())
