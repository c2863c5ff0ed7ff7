"""Token files: the ids equal the encoder's on each whole file, whatever the piece size or process count."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
import regex
from hypothesis import example, given, settings, strategies as st

from gpt2_tf import corpus
from gpt2_tf.encoder import PATTERN, get_encoder
from gpt2_tf.validate import GPT2Error

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'
END = 50256
MIXED = ("héllo wörld  \n\n\t  日本語のテキスト123abc's don't I'M  \r\n x = f(a, b)  # ünïcödé 🙂🙂\n"
         "    return x**2\t\t\n\n\n1,234.56e-7 'quoted' \"QUOTED\" ...!!! \u00a0\u2003wide\u3000space\n")


def texts() -> list:
    cases = [json.loads(line)['text'] for line in (FIXTURES / 'bpe-cases.jsonl').read_text().split('\n') if line]
    return cases + [MIXED * 40, ' ' * 5000 + 'end', pathlib.Path(corpus.__file__).read_text()]


def write_folder(folder: pathlib.Path, items: list) -> list:
    paths = []
    for i, text in enumerate(items):
        path = folder / 'sub' / f'{i:03d}.txt' if i % 2 else folder / f'{i:03d}.txt'
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding='utf-8', newline='')
        paths.append(path)
    return sorted(paths, key=str)


def as_read(text: str) -> str:
    """A document's text as a text file is read: its line breaks as \n (Python's text mode), none at its ends."""
    return text.replace('\r\n', '\n').replace('\r', '\n').strip('\n')


def expected(paths: list) -> list:
    """The encoder on each whole file as read (as_read), each followed by <|endoftext|>; empty ones left out."""
    encoder = get_encoder()
    ids = []
    for path in paths:
        text = as_read(open(path, encoding='utf-8', newline='').read())
        ids += encoder.encode(text) + [END] if text else []
    return ids


@pytest.mark.parametrize('processes, piece', [(1, 16), (1, 1 << 20), (2, 64)])
def test_ids_equal_encoding_each_whole_file(tmp_path, processes, piece):
    paths = write_folder(tmp_path / 'in', texts())
    info = corpus.encode_corpus([tmp_path / 'in'], tmp_path / 'out.bin', processes=processes, piece=piece)
    ids = corpus.read_tokens(tmp_path / 'out.bin')
    assert ids.dtype == np.dtype('<u2')
    assert np.asarray(ids).tolist() == expected(paths)
    assert info['tokens'] == len(ids) and info['documents'] == sum(1 for p in paths if as_read(p.read_text()))
    assert os.path.getsize(tmp_path / 'out.bin') == 2 * len(ids)  # flat little-endian uint16, no header
    assert info['vocab_sha256'] == corpus.vocabulary_sha256(get_encoder())
    assert sorted(os.listdir(tmp_path)) == ['in', 'out.bin', 'out.bin.json']


def pretokens(text: str) -> list:
    return regex.findall(PATTERN, text)


SEPARATED = ('<|endoftext|>\nFirst doc.\n<|endoftext|>\nSecond, doc two.\n\n<|endoftext|>\n\nThird <|endoftext|> inline.'
             '\r\n<|endoftext|>\r\n' + 'Fourth ' * 300 + '\n<|endoftext|>\n<|endoftext|>')
DOCUMENTS = ['First doc.', 'Second, doc two.', 'Third <|endoftext|> inline.', 'Fourth ' * 300]  # by hand


@pytest.mark.parametrize('processes, piece', [(1, 5), (1, 1 << 20), (2, 64)])
def test_lines_that_are_exactly_end_of_text_split_documents(tmp_path, processes, piece):
    # Each line <|endoftext|> ends a document (its line breaks and blank lines next to it go with it, empty
    # documents are left out); inside a line it is text. Small pieces put a separator across a read.
    encoder = get_encoder()
    (tmp_path / 'a.txt').write_text('\ufeff' + SEPARATED, encoding='utf-8', newline='')  # a byte-order mark: no text
    (tmp_path / 'b.txt').write_text('No separator.\n', encoding='utf-8', newline='')
    info = corpus.encode_corpus([tmp_path / 'a.txt', tmp_path / 'b.txt'], tmp_path / 'out.bin', processes=processes,
                                piece=piece)
    ids = sum((encoder._tiktoken.encode_ordinary(d) + [END] for d in DOCUMENTS + ['No separator.']), [])
    assert np.asarray(corpus.read_tokens(tmp_path / 'out.bin')).tolist() == ids
    assert info['documents'] == 5


def documents_by_hand(text: str) -> list:
    """The rule, on the whole text at once: split at lines that are exactly <|endoftext|>, with the line
    breaks next to them, and without those at the text's ends; empty parts dropped."""
    parts = regex.split(r'[\r\n]*(?<![^\r\n])<\|endoftext\|>(?=\r\n|\n|\r|\Z)[\r\n]*', text)
    return [p.strip('\r\n') for p in parts if p.strip('\r\n')]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['ab', ' ', '.', '\n', '\r\n', '\r', '<|endoftext|>', '<|end', 'oftext|>', 'x<']),
                max_size=30), st.integers(1, 20))
@example(['<|endoftext|>', '\n', '\n', 'ab'], 14)  # blank lines after a separator, in the next read
def test_streamed_documents_follow_the_separator_rule(words, size):
    import io

    text = ''.join(words)
    documents, parts = [], []
    for piece in corpus.pieces(io.StringIO(text, newline=''), size=size):
        if piece is None:
            documents.append(''.join(parts))
            parts = []
        else:
            parts.append(piece)
    assert documents == documents_by_hand(text), text


@settings(max_examples=600, deadline=None)
@given(st.text(alphabet="ab1 2'\n\r\t\x0b.,sdmlltrve\u00e9\u65e5\u00a0\u2028\u3000-_", max_size=40))
def test_every_cut_is_a_boundary_of_the_pretokenizer(text):
    # The property the streaming rests on: splitting at a cut changes no pre-token, so no id.
    for match in corpus.CUT.finditer(text, pos=1):
        at = match.start()
        assert pretokens(text[:at]) + pretokens(text[at:]) == pretokens(text), (text, at)


def test_pieces_end_at_cuts_and_join_to_the_text():
    import io

    *parts, end = corpus.pieces(io.StringIO(MIXED * 10), size=7)
    whole = (MIXED * 10).strip('\r\n')  # one document, without the line breaks at its ends
    assert end is None and ''.join(parts) == whole
    assert len(parts) > 50
    assert sum((pretokens(p) for p in parts), []) == pretokens(whole)


def test_text_of_letters_and_spaces_alone_is_cut_into_pieces():
    import io

    text = 'the quick brown fox jumps over the lazy dog ' * 200  # no punctuation, no digits (text8's kind)
    *parts, end = corpus.pieces(io.StringIO(text), size=256)
    assert end is None and len(parts) > 20 and max(map(len, parts)) < 2 * 256  # the carry stays bounded
    assert ''.join(parts) == text
    assert sum((pretokens(p) for p in parts), []) == pretokens(text)


def test_text_without_letters_or_digits_is_cut_into_pieces_too():
    import io

    text = '-- :) ** ==\n#!\t>>\n' * 300 + '.'  # punctuation, spaces, tabs and line breaks only
    *parts, end = corpus.pieces(io.StringIO(text), size=256)
    assert end is None and len(parts) > 20 and max(map(len, parts)) < 2 * 256
    assert ''.join(parts) == text
    assert sum((pretokens(p) for p in parts), []) == pretokens(text)


def test_a_run_without_cuts_is_searched_once_not_again_at_every_read(monkeypatch):
    import io

    searched, cut = [], corpus.cut

    def counted(text, start=1):
        searched.append(len(text) - start)
        return cut(text, start)

    monkeypatch.setattr(corpus, 'cut', counted)
    text = '=' * 20_000 + ' a'  # no cut until the end: the buffer grows by 256 characters a read
    assert ''.join(p for p in corpus.pieces(io.StringIO(text), size=256) if p is not None) == text
    assert sum(searched) < 4 * len(text)  # each read searches what it added (searching all again: 40x this)


def test_ids_outside_the_vocabulary_are_refused_before_any_window(tmp_path):
    from gpt2_tf.dataset import token_windows

    ids = np.arange(300_000, dtype='<u2') % 50257
    ids[123_456] = 60000
    ids.tofile(tmp_path / 'no-sidecar.bin')
    with pytest.raises(GPT2Error, match=r"no-sidecar.bin holds token id 60000 at token 123,456, outside the model's "
                                        r"vocabulary \[0, 50257\)"):
        token_windows(str(tmp_path / 'no-sidecar.bin'), 128, n_vocab=50257)
    ids[123_456] = 7
    ids.tofile(tmp_path / 'no-sidecar.bin')
    assert token_windows(str(tmp_path / 'no-sidecar.bin'), 128, n_vocab=50257)[0].sample(4).shape == (4, 128)


def test_folders_follow_the_glob_and_sorted_order(tmp_path):
    (tmp_path / 'b.txt').write_text('second')
    (tmp_path / 'a.md').write_text('first')
    (tmp_path / 'c.txt').write_text('third')
    corpus.encode_corpus([tmp_path], tmp_path / 'all.bin', glob='*.txt')
    assert np.asarray(corpus.read_tokens(tmp_path / 'all.bin')).tolist() == expected([tmp_path / 'b.txt',
                                                                                       tmp_path / 'c.txt'])
    corpus.encode_corpus([tmp_path], tmp_path / 'md.bin', glob='*.md')
    assert corpus.read_sidecar(str(tmp_path / 'md.bin'))['documents'] == 1


def test_stdin_is_one_document(tmp_path):
    script = ('import sys; from gpt2_tf import corpus; '
              f'corpus.encode_corpus(["-"], {str(tmp_path / "in.bin")!r})')
    subprocess.run([sys.executable, '-c', script], input=MIXED, text=True, check=True,
                   cwd=pathlib.Path(__file__).parent.parent)
    assert np.asarray(corpus.read_tokens(tmp_path / 'in.bin')).tolist() == get_encoder().encode(as_read(MIXED)) + [END]


def test_a_blank_run_too_long_for_tiktoken_is_encoded_as_the_encoder_encodes_it(tmp_path):
    # about 10^6 blanks without a cut make tiktoken's regex engine panic; the encoder takes the original's way
    (tmp_path / 'blank.txt').write_text('a' + ' ' * 1_100_000 + 'b\n' + '\t' * 1_200_000 + 'c')
    corpus.encode_corpus([tmp_path / 'blank.txt'], tmp_path / 'out.bin', processes=1)
    assert np.asarray(corpus.read_tokens(tmp_path / 'out.bin')).tolist() == expected([tmp_path / 'blank.txt'])


def test_a_failed_run_leaves_no_output_and_keeps_an_older_one(tmp_path):
    (tmp_path / 'a.txt').write_text('fine text ' * 100)
    (tmp_path / 'b.txt').write_bytes(b'caf\xe9 is latin-1')
    with pytest.raises(GPT2Error, match=r'b\.txt: not UTF-8'):
        corpus.encode_corpus([tmp_path], tmp_path / 'out.bin')
    assert sorted(os.listdir(tmp_path)) == ['a.txt', 'b.txt']
    corpus.encode_corpus([tmp_path / 'a.txt'], tmp_path / 'out.bin')
    before = (tmp_path / 'out.bin').read_bytes()
    with pytest.raises(GPT2Error):
        corpus.encode_corpus([tmp_path / 'a.txt', tmp_path / 'b.txt'], tmp_path / 'out.bin')
    assert (tmp_path / 'out.bin').read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith('.partial')]


@pytest.mark.parametrize('handler', [signal.default_int_handler, 'exit'], ids=['ctrl-c', 'a-command-s-own'])
def test_ctrl_c_as_the_files_move_into_place_waits_for_both(tmp_path, monkeypatch, handler):
    # between the .bin's rename and its sidecar's, a new .bin stood beside the older run's sidecar
    (tmp_path / 'a.txt').write_text('fine text ' * 100)
    (tmp_path / 'b.txt').write_text('other words ' * 30)
    corpus.encode_corpus([tmp_path / 'a.txt'], tmp_path / 'out.bin')
    replace = os.replace

    def interrupted(source, target):
        replace(source, target)
        if target.endswith('out.bin'):
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends, right after the first rename

    monkeypatch.setattr(corpus.os, 'replace', interrupted)
    previous = signal.signal(signal.SIGINT, handler if callable(handler) else lambda *_: sys.exit(130))
    try:
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            corpus.encode_corpus([tmp_path / 'b.txt'], tmp_path / 'out.bin')
    finally:
        signal.signal(signal.SIGINT, previous)
    assert json.loads((tmp_path / 'out.bin.json').read_text())['tokens'] == len(corpus.read_tokens(tmp_path / 'out.bin'))
    assert np.asarray(corpus.read_tokens(tmp_path / 'out.bin')).tolist() == expected([tmp_path / 'b.txt'])


def test_a_bin_without_sidecar_reads_as_uint16_and_damage_is_named(tmp_path):
    ids = np.array([1, 2, 50256, 65535], '<u2')
    ids.tofile(tmp_path / 'nano.bin')
    assert np.asarray(corpus.read_tokens(tmp_path / 'nano.bin')).tolist() == ids.tolist()
    corpus.encode_corpus([FIXTURES / 'bpe-cases.jsonl'], tmp_path / 'x.bin')
    with open(tmp_path / 'x.bin', 'r+b') as f:
        f.truncate(os.path.getsize(tmp_path / 'x.bin') - 2)
    with pytest.raises(GPT2Error, match='truncated'):
        corpus.read_tokens(tmp_path / 'x.bin')
    with pytest.raises(GPT2Error, match='no token file'):
        corpus.read_tokens(tmp_path / 'missing.bin')
    with pytest.raises(GPT2Error, match='no such file or folder'):
        corpus.encode_corpus([tmp_path / 'nowhere'], tmp_path / 'y.bin')


def test_large_vocabularies_get_uint32():
    assert corpus.dtype_for(50257) == np.dtype('<u2') and corpus.dtype_for(65536) == np.dtype('<u2')
    assert corpus.dtype_for(65537) == np.dtype('<u4')


def test_windows_cover_every_offset_uniformly_within_their_ranges(tmp_path):
    tokens = np.arange(40, dtype='<u2')
    windows = corpus.Windows(tokens, 8, ranges=[(0, 10), (20, 40)], seed=0)
    firsts = windows.sample(6000)[:, 0]
    # Offsets 0..2 of the first range and 20..32 of the second: 16 starts, each about 1/16 of the draws.
    assert sorted(set(firsts.tolist())) == [0, 1, 2] + list(range(20, 33))
    counts = np.bincount(firsts, minlength=40)[[0, 1, 2] + list(range(20, 33))]
    assert counts.min() > 6000 / 16 * 0.75 and counts.max() < 6000 / 16 * 1.25
    rows = corpus.Windows(tokens, 8, ranges=[(0, 10), (20, 40)], seed=0).sample(50)
    assert (np.diff(rows, axis=1) == 1).all()  # contiguous windows, never across a range's end
    assert np.array_equal(rows, corpus.Windows(tokens, 8, ranges=[(0, 10), (20, 40)], seed=0).sample(50))


def test_the_validation_split_falls_after_an_end_of_text():
    tokens = np.array([1, 2, END, 3, 4, 5, END, 6, 7, END], '<u2')
    assert corpus.split_documents(tokens, 0.5, end=END) == ((0, 3), (3, 10))
    assert corpus.split_documents(tokens, 0.2, end=END) == ((0, 7), (7, 10))
    with pytest.raises(GPT2Error, match='at least two documents'):
        corpus.split_documents(np.array([1, 2, 3, END], '<u2'), 0.5, end=END)
    # a short first document and a long last one: a tenth asked, nearly all would be held out
    lopsided = np.array([1, END] + [5] * 98 + [END], '<u2')
    with pytest.raises(GPT2Error, match=r'^holding out whole documents leaves 2\.0% of the tokens for training, not '
                                        r'about 90% \(the documents after token 2 are one long run\): give '
                                        r'--val_dataset a file of its own$'):
        corpus.split_documents(lopsided, 0.1, end=END)


def test_a_split_too_short_for_a_window_names_its_part_and_the_fraction(tmp_path):
    from gpt2_tf.dataset import token_windows

    np.array(([7] * 99 + [END]) * 20, '<u2').tofile(tmp_path / 'docs.bin')  # 20 documents of 100 tokens
    for fraction, part, remedy in ((0.05, 'the validation part', 'a larger'), (0.95, 'the training part', 'a smaller')):
        with pytest.raises(GPT2Error, match=f'^{part} of {tmp_path / "docs.bin"} \\([\\d,]+ tokens\\) is shorter '
                                            f'than one training window of 128 tokens \\(n_ctx\\): give more text, or '
                                            f'{remedy} --val_fraction$'):
            token_windows(str(tmp_path / 'docs.bin'), 128, n_vocab=50257, val_fraction=fraction)


def test_a_file_that_is_not_utf8_is_named_with_its_first_bad_byte(tmp_path):
    (tmp_path / 'late.txt').write_bytes(b'fine text\n' * 300_000 + b'caf\xe9 ok')  # past the first megabyte read
    with pytest.raises(GPT2Error, match=r'late\.txt: not UTF-8 text \(invalid continuation byte at byte '
                                        r'3,000,003\); convert it to UTF-8 or leave it out$'):
        corpus.encode_corpus([tmp_path / 'late.txt'], tmp_path / 'out.bin')
    (tmp_path / 'late.txt').write_bytes(b'fine text\n' * 300_000 + b'caf\xe9')  # cut inside its last character
    with pytest.raises(GPT2Error, match=r'at byte 3,000,003\); convert'):
        corpus.encode_corpus([tmp_path / 'late.txt'], tmp_path / 'out.bin')


def test_a_bin_of_odd_size_without_a_sidecar_says_so(tmp_path):
    (tmp_path / 'odd.bin').write_bytes(b'\x01\x00\x02')
    with pytest.raises(GPT2Error, match=r'odd\.bin: 3 bytes are not whole uint16 ids \(a \.bin without a sidecar is '
                                        r'read as uint16\); the file is truncated'):
        corpus.read_tokens(tmp_path / 'odd.bin')


def test_short_reads_before_the_end_lose_nothing():
    import io

    class Trickle(io.StringIO):  # a pipe that hands over at most 5 characters a read, long before its end
        def read(self, size=-1):
            return super().read(min(size, 5))

        def readline(self, size=-1):
            return super().readline(min(size, 5))

    *parts, end = corpus.pieces(Trickle(MIXED * 10), size=64)
    whole = (MIXED * 10).strip('\r\n')
    assert end is None and ''.join(parts) == whole
    assert sum((pretokens(p) for p in parts), []) == pretokens(whole)


def test_the_default_process_count_keeps_within_a_containers_cpu_quota(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    (tmp_path / 'cpu.max').write_text('50000 100000\n')  # half a CPU: one worker
    assert corpus.default_processes(str(tmp_path / 'cpu.max')) == 1
    (tmp_path / 'cpu.max').write_text('150000 100000\n')  # 1.5 CPUs: 2 workers, where there are 2
    assert corpus.default_processes(str(tmp_path / 'cpu.max')) == min(cpus, 2)
    (tmp_path / 'cpu.max').write_text('max 100000\n')  # no quota
    assert corpus.default_processes(str(tmp_path / 'cpu.max')) == cpus
    assert corpus.default_processes(str(tmp_path / 'absent')) == cpus


def test_inputs_without_text_are_refused_not_written_empty(tmp_path):
    (tmp_path / 'blank.txt').write_text('\n\r\n\n<|endoftext|>\n\n')
    with pytest.raises(GPT2Error, match=r'^no text in .*blank\.txt: nothing to encode \(empty documents are left '
                                        r'out\)$'):
        corpus.encode_corpus([tmp_path / 'blank.txt'], tmp_path / 'out.bin')
    assert sorted(os.listdir(tmp_path)) == ['blank.txt']


def test_a_vocabulary_without_end_of_text_is_refused_before_any_work(tmp_path):
    from gpt2_tf.dataset import load_dataset
    from gpt2_tf.encoder import Encoder, bytes_to_unicode

    table = {c: i for i, c in enumerate(bytes_to_unicode().values())}  # the 256 bytes alone
    (tmp_path / 'encoder.json').write_text(json.dumps(table))
    (tmp_path / 'vocab.bpe').write_text('#version: 0.2\n')
    (tmp_path / 'a.txt').write_text('Some text.')
    message = (r'^encoded text ends each document with <\|endoftext\|>, which this vocabulary does not have: add it '
               r'to the vocabulary, or use one that has it \(GPT-2.s: without --model_dir\)$')
    files = (str(tmp_path / 'encoder.json'), str(tmp_path / 'vocab.bpe'))
    with pytest.raises(GPT2Error, match=message):
        corpus.vocabulary_of(str(tmp_path))  # encode --model_dir, Beam's too
    with pytest.raises(GPT2Error, match=message):
        corpus.encode_corpus([tmp_path / 'a.txt'], tmp_path / 'out.bin', encoder_files=files, processes=1)
    assert not list(tmp_path.glob('out.bin*'))
    with pytest.raises(GPT2Error, match=message):  # fine-tuning on text
        load_dataset(str(tmp_path / 'a.txt'), Encoder(table, []))
