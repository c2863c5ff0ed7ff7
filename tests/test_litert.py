"""The LiteRT export, run by the LiteRT interpreter in a process that imports no TensorFlow."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf import HParams
from gpt2_tf.assets import bundled_vocabulary
from gpt2_tf.litert import export_litert
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES, assert_close, require
from support import ended_pid

require('ai_edge_litert')

ROOT = pathlib.Path(__file__).parent.parent

# Runs in a fresh interpreter that finds only the standard library, numpy and the LiteRT runtime, as a device
# would: prefill logits for a prompt, then the runner's greedy and top-k tokens.
RUNNER = '''
import importlib.abc, json, sys
class Device(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] not in {*sys.stdlib_module_names, 'numpy', 'ai_edge_litert', 'gpt2_tf'}:
            raise ModuleNotFoundError(f'{name} is not installed on the device', name=name)
sys.meta_path.insert(0, Device())
import numpy as np
from ai_edge_litert.interpreter import Interpreter
from gpt2_tf import litert_run
folder, prompt, length, seed = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
interpreter = Interpreter(model_path=folder + '/model.tflite', num_threads=2)
shape = json.load(open(folder + '/model.json'))['signatures']['prefill']['inputs']['kv_cache']['shape']
out = interpreter.get_signature_runner('prefill')(tokens=np.array([prompt], np.int32),
    input_pos=np.arange(len(prompt), dtype=np.int32), kv_cache=np.zeros(shape, np.float32))
try:
    litert_run.encoder_of(folder)
    tokenizer = 'loaded'
except litert_run.GPT2Error as e:
    tokenizer = str(e)
print(json.dumps({
    'tokenizer': tokenizer,
    'logits': out['logits'][0].tolist(),
    'greedy': litert_run.generate(folder, prompt, length),
    'top_k': litert_run.generate(folder, prompt, length, top_k=40, temperature=0.5, seed=seed),
    'tensorflow': 'tensorflow' in sys.modules}))
'''


def run_exported(folder, prompt, length, seed=5) -> dict:
    done = subprocess.run([sys.executable, '-c', RUNNER, str(folder), json.dumps(prompt), str(length), str(seed)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result['tensorflow'] is False  # the runner needs the LiteRT interpreter only
    assert result['tokenizer'] == "encoding the prompt's text needs the regex package: pip install regex"
    return result


@pytest.fixture(scope='module')
def tiny_export(tmp_path_factory, tiny_vocabulary):
    """tf1-tiny exported with a cache of 8 positions, for the tests that only run it (or damage a copy)."""
    folder = tmp_path_factory.mktemp('tiny_export')
    export_litert(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), folder, max_len=8, vocabulary=tiny_vocabulary)
    return folder


def check_against_library(model, folder, prompt, length, seed=5):
    result = run_exported(folder, prompt, length, seed)
    reference = model(np.array([prompt]))['logits'].numpy()[0, -1]
    assert_close(result['logits'], reference, 'prefill logits')
    greedy = gpt2_tf.sample_sequence(model, length, context=prompt, top_k=1)[0, len(prompt):]
    assert result['greedy'] == greedy.tolist()
    drawn = gpt2_tf.sample_sequence(model, length, context=prompt, top_k=40, temperature=0.5,
                                    seed=np.array([[seed, 0]]))[0, len(prompt):]
    assert result['top_k'] == drawn.tolist()  # the same rule and the same noise: the same draws
    return result


@pytest.mark.parametrize('name', ['tf1-tiny', 'tf1-tiny-hot'])
def test_fixtures_prefill_and_decode_give_the_library_s_logits_and_tokens(tmp_path, fixture_vocabulary, name):
    model = gpt2_tf.load_model(FIXTURES / name)
    reference = np.load(FIXTURES / name / 'reference.npz')
    prompt = reference['tokens'][0, :8].tolist()
    export_litert(model, tmp_path, max_len=model.hparams.n_ctx, vocabulary=fixture_vocabulary(model.hparams.n_vocab))
    result = check_against_library(model, tmp_path, prompt, 20)
    # And against the original graph itself: the prefill of the whole fixture row ends at its last position.
    row = reference['tokens'][0].tolist()
    assert_close(run_exported(tmp_path, row, 1)['logits'], reference['logits'][0, -1], 'original graph')
    assert len(result['greedy']) == 20


def test_description_and_a_short_cache(tmp_path, tiny_with_vocabulary):
    model = gpt2_tf.load_model(tiny_with_vocabulary)
    out = tmp_path / 'out'
    info = export_litert(model, out, max_len=np.int64(16))  # a numpy integer, as a computed length often is
    described = json.loads((out / 'model.json').read_text())
    assert described['max_len'] == info['max_len'] == 16
    hp = model.hparams
    assert described['signatures']['decode']['inputs']['kv_cache']['shape'] == [hp.n_layer, 2, 1, hp.n_head, 16,
                                                                                 hp.head_size]
    assert sorted(os.listdir(out)) == ['encoder.json', 'model.json', 'model.tflite', 'vocab.bpe']
    for name in ('encoder.json', 'vocab.bpe'):  # by default the model's own vocabulary, the folder it was loaded from
        assert (out / name).read_bytes() == (tiny_with_vocabulary / name).read_bytes(), name
    assert info['bytes'] == os.path.getsize(out / 'model.tflite')
    check_against_library(model, out, [3, 1, 4, 1, 5], 12)


def test_a_vocabulary_of_more_tokens_than_the_model_is_refused_before_converting(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')  # no vocabulary of its own: the bundled one, 50257 tokens
    with pytest.raises(GPT2Error, match=r"vocabulary .*encoder.json holds 50257 tokens, more than the model's 512"):
        export_litert(model, tmp_path / 'out', max_len=8)
    assert not (tmp_path / 'out').exists()


def test_an_existing_empty_folder_stays_the_folder_written_into(tmp_path, monkeypatch, tiny_with_vocabulary):
    import shutil

    model = gpt2_tf.load_model(tiny_with_vocabulary)
    mounted = tmp_path / 'mounted'  # a mount point, or the working folder: it cannot be replaced by another
    mounted.mkdir()
    inode = mounted.stat().st_ino
    monkeypatch.chdir(mounted)
    export_litert(model, '.', max_len=8)
    assert mounted.stat().st_ino == inode
    assert sorted(os.listdir(mounted)) == ['encoder.json', 'model.json', 'model.tflite', 'vocab.bpe']
    # this model's 512-token vocabulary has no <|endoftext|>: no end_of_text to stop at
    assert json.loads((mounted / 'model.json').read_text())['vocabulary'] == {'encoder': 'encoder.json',
                                                                               'bpe': 'vocab.bpe'}
    empty = tmp_path / 'empty'
    empty.mkdir()
    monkeypatch.setattr(shutil, 'copyfile', lambda *a: (_ for _ in ()).throw(OSError(28, 'No space left on device')))
    with pytest.raises(OSError, match='No space left'):
        export_litert(model, empty, max_len=8)
    assert empty.stat().st_ino and os.listdir(empty) == []  # still there, still empty
    monkeypatch.undo()
    gone = ended_pid()
    (empty / f'.gpt2_tf-partial-{gone}-x1y2z3_4').mkdir()  # what an export killed mid-write left in the folder
    (empty / f'.gpt2_tf-partial-{gone}-x1y2z3_4' / 'model.tflite').write_bytes(b'half')
    export_litert(model, empty, max_len=8)  # the folder still counts as empty, and the leftover goes
    assert sorted(os.listdir(empty)) == ['encoder.json', 'model.json', 'model.tflite', 'vocab.bpe']
    busy = tmp_path / 'busy'
    busy.mkdir()
    (busy / f'.gpt2_tf-partial-{os.getpid()}-y1y2y3_4').mkdir()  # another export, still running, writes here
    with pytest.raises(GPT2Error, match='exists and is not empty'):
        export_litert(model, busy, max_len=8)
    assert os.listdir(busy) == [f'.gpt2_tf-partial-{os.getpid()}-y1y2y3_4']  # left to its writer


def test_an_export_takes_the_vocabulary_convert_would_and_refuses_one_it_cannot_hold(tmp_path, capsys,
                                                                                     tiny_with_vocabulary):
    from gpt2_tf.cli import main
    from gpt2_tf.hf import save_hf

    save_hf(gpt2_tf.load_model(tiny_with_vocabulary), tmp_path / 'added')
    (tmp_path / 'added' / 'added_tokens.json').write_text('{"<pad>": 511}')
    assert main(['export', str(tmp_path / 'added'), str(tmp_path / 'out'), '--format', 'litert']) == 2
    assert 'added tokens' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_int8_keeps_a_third_of_the_bytes_and_the_int8_model_s_logits(tmp_path):
    model = gpt2_tf.load_model(ROOT / 'gpt2_tf' / 'assets' / 'test-checkpoint')  # 0.81M parameters
    quantized = gpt2_tf.load_model(ROOT / 'gpt2_tf' / 'assets' / 'test-checkpoint', dtype='int8')
    full = export_litert(model, tmp_path / 'f32', max_len=32)
    small = export_litert(quantized, tmp_path / 'int8', max_len=32)
    assert small['dtype'] == 'int8' and small['bytes'] <= 0.35 * full['bytes']  # one int8 wte, int8 matrices
    prompt = [464, 2068, 7586, 21831, 18045]
    result = run_exported(tmp_path / 'int8', prompt, 16)
    assert_close(result['logits'], quantized(np.array([prompt]))['logits'].numpy()[0, -1], 'int8 prefill')
    greedy = gpt2_tf.sample_sequence(quantized, 16, context=prompt, top_k=1)[0, len(prompt):]
    assert result['greedy'] == greedy.tolist()
    # Against float32 the tokens are a measured departure, not asserted equal: bench/bench_litert.py reports it.


def test_bad_options_are_refused_in_one_line(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    for options, message in [(dict(max_len=0), r'--max-len must be an integer in \[1, 32\]'),
                             (dict(max_len=33), r'--max-len must be an integer in \[1, 32\]'),
                             (dict(dtype='float16'), '--dtype for a LiteRT export must be one of'),
                             (dict(dtype='int8'), 'the model holds float32 weights')]:
        with pytest.raises(GPT2Error, match=message) as caught:
            export_litert(model, tmp_path / 'out', **options)
        assert '\n' not in str(caught.value)
    assert not (tmp_path / 'out').exists()


def test_a_failed_export_leaves_nothing_and_half_a_vocabulary_is_refused_first(tmp_path, monkeypatch,
                                                                               fixture_vocabulary):
    import shutil

    half = tmp_path / 'half'
    shutil.copytree(FIXTURES / 'tf1-tiny', half)
    shutil.copyfile(bundled_vocabulary()[0], half / 'encoder.json')  # without vocab.bpe
    done = cli('export', str(half), str(tmp_path / 'out'), '--format', 'litert')
    assert done.returncode == 2 and done.stderr.strip().endswith('has encoder.json but not vocab.bpe: copy both '
                                                                 'files of the vocabulary in (or neither, for the '
                                                                 'bundled GPT-2 one) (a written folder carries only '
                                                                 'the vocabulary pair: encoder.json and vocab.bpe, '
                                                                 'or vocab.json and merges.txt)'), done.stderr
    monkeypatch.setattr(shutil, 'copyfile', lambda *a: (_ for _ in ()).throw(OSError(28, 'No space left on device')))
    with pytest.raises(OSError, match='No space left'):
        export_litert(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), tmp_path / 'out', max_len=8,
                      vocabulary=fixture_vocabulary(512))
    assert sorted(os.listdir(tmp_path)) == ['half']  # neither out nor its staging


@pytest.mark.parametrize('argv, message', [
    (['Hi', '--length', '0'], 'length must be a positive integer, got 0'),
    (['Hi', '--length', '9'], 'length 9 is longer than the window'),
    (['Hello there you', '--length', '7'], r'3 tokens \+ length 7 exceeds the window by 1'),
    (['', '--length', '3'], 'the prompt is empty'),
    (['Hi', '--length', '2', '--top_k', '-5'], 'top_k must be an integer >= 0'),
    (['Hi', '--length', '2', '--top_k', '5', '--temperature', '-1'], r'temperature must be in \[0, 2\]'),
    (['Hi', '--length', '2', '--seed', str(2 ** 64)], 'seed 18446744073709551616 is out of range'),
    (['Hi', '--length', '9', '--n_ctx', '16'], r'the prompt \(1 tokens\) and length 9 need 9 positions; this '
                                                r"export's cache has 8: export again with a larger --max-len \(at most "
                                                r'n_ctx = 16\), or ask for fewer tokens'),
    (['Hello', '--length', '2', '--n_vocab', '300'], "the prompt's token id 15496 is outside the vocabulary "
                                                      r'\[0, 300\): the vocabulary files hold more tokens than the '
                                                      'model: use the ones made for it$'),  # as gpt2-tf generate
    (['ab\udcffcd', '--length', '2'], r'the prompt is not UTF-8 text \(byte 0xff at character 2\): give it in '
                                       'UTF-8$'),  # as gpt2-tf generate; the encoder would have read U+FFFD
])
def test_the_runner_checks_its_arguments_by_the_librarys_rules(tmp_path, capsys, argv, message):
    import shutil

    from gpt2_tf import litert_run

    folder = tmp_path / 'export'  # checked before the interpreter loads: model.json's cache of 8 positions
    folder.mkdir()
    (folder / 'model.tflite').write_bytes(b'')
    hparams = {'n_ctx': 8, 'n_vocab': 50257}
    for name in list(hparams):  # the export's own hparams, where a case sets them
        if f'--{name}' in argv:
            at = argv.index(f'--{name}')
            hparams[name], argv = int(argv[at + 1]), argv[:at] + argv[at + 2:]
    (folder / 'model.json').write_text(json.dumps({'hparams': hparams, 'signatures': {'decode': {'inputs': {
        'kv_cache': {'shape': [1, 2, 1, 2, 8, 4]}}}}}))
    for path, name in zip(bundled_vocabulary(), ('encoder.json', 'vocab.bpe')):
        shutil.copyfile(path, folder / name)
    assert litert_run.main([str(folder), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('python -m gpt2_tf.litert_run: error: '), err  # one line, no usage
    assert re.search(message, err[0]), err
    assert litert_run.main([str(tmp_path), 'Hi']) == 2
    assert 'is not a LiteRT export (model.tflite and its model.json)' in capsys.readouterr().err


def test_nan_logits_are_refused_with_the_library_s_error(tmp_path, tiny_vocabulary):
    import tensorflow as tf

    from gpt2_tf import litert_run

    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    model.ln_f.g.assign(tf.tensor_scatter_nd_update(model.ln_f.g, [[0]], [np.nan]))  # every logit NaN
    export_litert(model, tmp_path, max_len=8, vocabulary=tiny_vocabulary)
    with pytest.raises(GPT2Error) as library:
        gpt2_tf.sample_sequence(model, 3, context=[1, 2], top_k=1)
    for options in (dict(top_k=1), dict(top_k=40, temperature=0.5, seed=1)):  # argmax said token 0, each step
        with pytest.raises(GPT2Error) as caught:
            litert_run.generate(tmp_path, [1, 2], 3, **options)
        assert str(caught.value) == str(library.value)


def test_generate_without_a_seed_draws_with_a_random_key_as_the_library(tiny_export, monkeypatch):
    import secrets

    from gpt2_tf import litert_run

    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    drawn = gpt2_tf.sample_sequence(model, 6, context=[1, 2], top_k=40, temperature=2.0,
                                    seed=np.array([[7, 9]]))[0, 2:].tolist()
    assert drawn != gpt2_tf.sample_sequence(model, 6, context=[1, 2], top_k=1)[0, 2:].tolist()  # not greedy's
    keys = iter([7, 9])
    monkeypatch.setattr(secrets, 'randbits', lambda bits: next(keys))  # the random key, made known
    assert litert_run.generate(tiny_export, [1, 2], 6, top_k=40, temperature=2.0) == drawn


@pytest.mark.parametrize('options, message', [
    (dict(top_k=40, temperature=-1.0, seed=1), r'temperature must be in \[0, 2\] \(0 is greedy\), got -1.0'),
    (dict(top_k=-3, seed=1), r'top_k must be an integer >= 0 \(0: no truncation\), got -3'),
    (dict(top_k=40, seed=2 ** 70), 'seed 1180591620717411303424 is out of range'),
    (dict(top_k=40, seed='1'), r"seed must be an integer s \(the library's seed=\[\[s, 0\]\]\) or None"),
    (dict(top_k=40, seed=(1, 2)), r"seed must be an integer s \(the library's seed=\[\[s, 0\]\]\) or None"),
])
def test_generate_checks_its_options_by_the_library_s_rules(tiny_export, options, message):
    from gpt2_tf import litert_run

    with pytest.raises(GPT2Error, match=message) as caught:
        litert_run.generate(tiny_export, [1, 2], 3, **options)
    assert '\n' not in str(caught.value)


def test_a_prompt_is_any_one_row_of_integers(tiny_export):
    from gpt2_tf import litert_run

    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    greedy = gpt2_tf.sample_sequence(model, 4, context=[15, 11, 314], top_k=1)[0, 3:].tolist()
    for ids in ([15, 11, 314], (15, 11, 314), np.array([15, 11, 314]), np.array([15, 11, 314], np.uint16)):
        assert litert_run.generate(tiny_export, ids, 4) == greedy
    for ids, message in [([[15, 11, 314]], r'the prompt must be one row of token ids, got shape \[1, 3\]'),
                         (np.array([15.0, 11.0]), 'the prompt must be integers, got float64'),
                         ('Hello', 'the prompt must be token ids, got text: encode it first')]:
        with pytest.raises(GPT2Error, match=message):
            litert_run.generate(tiny_export, ids, 4)


def damage(folder, how: str) -> None:
    model, described = folder / 'model.tflite', json.loads((folder / 'model.json').read_text())
    if how == 'empty model':
        model.write_bytes(b'')
    elif how == 'truncated model':
        model.write_bytes(model.read_bytes()[:model.stat().st_size // 2])
    elif how == 'no n_ctx':
        del described['hparams']['n_ctx']
    else:  # another export's model.json: a cache of 4 positions, the model's is 8
        for signature in described['signatures'].values():
            signature['inputs']['kv_cache']['shape'][4] = 4
    (folder / 'model.json').write_text(json.dumps(described))


@pytest.mark.parametrize('how', ['empty model', 'truncated model', 'no n_ctx', 'another cache'])
def test_a_damaged_export_is_refused_in_one_line(tiny_export, tmp_path, capsys, how):
    import shutil

    from gpt2_tf import litert_run

    folder = tmp_path / 'export'
    shutil.copytree(tiny_export, folder)
    damage(folder, how)
    named = 'model.json' if how == 'no n_ctx' else 'model.tflite'
    message = (re.escape(f'{folder} is not a complete LiteRT export (its {named} ') + '.*' +
               re.escape(f'): export it again with gpt2-tf export MODEL {folder} --format litert') + '$')
    with pytest.raises(GPT2Error, match=message) as caught:
        litert_run.generate(folder, [1, 2], 3)
    assert '\n' not in str(caught.value)
    assert litert_run.main([str(folder), 'ab', '--length', '3']) == 2  # 'ab' is one token, 397, of the model's 512
    err = [line for line in capsys.readouterr().err.strip().splitlines() if 'XNNPACK' not in line]  # LiteRT's
    assert len(err) == 1 and re.search(message, err[0]), err
    if how == 'empty model':  # a bad thread count is not taken for damage
        with pytest.raises(GPT2Error, match='threads must be an integer >= 1, got 0'):
            litert_run.generate(tiny_export, [1, 2], 3, threads=0)


@pytest.mark.slow
def test_124m_s_widths(tmp_path, random_checkpoint):
    # 124M's vocabulary, width and heads at two blocks: the converter's time grows with blocks, the shapes it
    # must handle do not.
    model = gpt2_tf.load_model(random_checkpoint(dataclasses.replace(HParams.named('124M'), n_layer=2), scale=0.02))
    export_litert(model, tmp_path, max_len=64)
    check_against_library(model, tmp_path, [464, 2068, 7586, 21831, 18045, 625, 262, 16931], 16)


def cli(*args, **options):
    return subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, **options)


def test_the_command_exports_and_the_runner_continues_a_prompt(tmp_path):
    done = cli('export', 'test', str(tmp_path / 'out'), '--format', 'litert', '--max-len', '48')
    assert done.returncode == 0, done.stderr
    assert 'LiteRT model written' in done.stdout
    assert json.loads((tmp_path / 'out' / 'model.json').read_text())['max_len'] == 48
    run = subprocess.run([sys.executable, '-m', 'gpt2_tf.litert_run', str(tmp_path / 'out'), 'Hello there',
                          '--length', '12'], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    model = gpt2_tf.load_model(ROOT / 'gpt2_tf' / 'assets' / 'test-checkpoint')
    encoder = gpt2_tf.get_encoder()
    ids = encoder.encode('Hello there')
    expected = gpt2_tf.sample_sequence(model, 12, context=ids, top_k=1)[0, len(ids):]
    assert run.stdout.rstrip('\n') == 'Hello there' + encoder.decode(expected)


@pytest.mark.parametrize('flags, message', [(['--max-len', '0'], '--max-len must be an integer in [1, 128]'),
                                            (['--max-len', '129'], '--max-len must be an integer in [1, 128]'),
                                            (['--dtype', 'bfloat16'], '--dtype for a LiteRT export must be one of')])
def test_bad_export_options_are_one_line(tmp_path, flags, message):
    done = cli('export', 'test', str(tmp_path / 'out'), '--format', 'litert', *flags)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / 'out').exists()
