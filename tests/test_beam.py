"""The Beam pipeline on the DirectRunner with 2 worker processes: one result per input, equal to the library's."""

import glob
import hashlib
import os
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpt2_tf
import gpt2_tf.scoring
from gpt2_tf.assets import bundled_checkpoint, bundled_vocabulary

from conftest import require

require('apache_beam')

from apache_beam.io.localfilesystem import LocalFileSystem  # noqa: E402

from gpt2_tf.beam import GPT2ModelHandler, Tokenize, _padded, main  # noqa: E402
from gpt2_tf.validate import GPT2Error  # noqa: E402


def inputs(tmp_path, n=200):
    rng = np.random.default_rng(0)
    words = 'the a cat dog sat ran on under mat log and then quietly very far home'.split()
    lines = [' '.join(rng.choice(words, rng.integers(1, 30))) for _ in range(n)]
    lines[3] = ''  # empty: an error record, not a crash
    lines[7] = 'word ' * 300  # longer than n_ctx = 128: windows for score, an error for generate
    path = tmp_path / 'texts.txt'
    path.write_text('\n'.join(lines) + '\n')
    return path, lines


def run(task, tmp_path, path, *extra):
    out = tmp_path / task
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.beam', task, '--model_dir', bundled_checkpoint(),
                           '--input', str(path), '--output', str(out / 'part'), '--runner', 'DirectRunner',
                           '--direct_running_mode', 'multi_processing', '--direct_num_workers', '2', *extra],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for f in sorted(glob.glob(str(out / 'part*.jsonl'))) for line in open(f)]
    return {r['key']: r for r in records}, records


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


def test_score_pipeline_gives_one_result_per_input_equal_to_the_library(tmp_path, model):
    path, lines = inputs(tmp_path)
    by_key, records = run('score', tmp_path, path)
    assert len(records) == len(lines) == len(by_key)  # exactly one each, none lost
    for number, line in enumerate(lines, start=1):
        record = by_key[f'{path}:{number}']
        ids = gpt2_tf.encode(line)
        if len(ids) < 2:
            assert 'error' in record and 'scoring needs 2' in record['error']
            continue
        expected = (gpt2_tf.score(model, [ids])[0] if len(ids) <= 128
                    else gpt2_tf.scoring.window_log_probs(model, ids, stride=64))
        lp = np.array(record['log_probs'])
        assert record['tokens'] == len(ids) - 1
        assert np.abs(lp - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
        assert record['nll'] == pytest.approx(-expected.mean(), rel=1e-5)


def test_generate_pipeline_is_seeded_per_key_whatever_the_batching(tmp_path, model):
    path, lines = inputs(tmp_path, n=120)
    by_key, records = run('generate', tmp_path, path, '--length', '10', '--seed', '7', '--top_k', '40')
    assert len(records) == len(lines)
    for number, line in enumerate(lines, start=1):
        key = f'{path}:{number}'
        record = by_key[key]
        ids = gpt2_tf.encode(line)
        if not ids or len(ids) + 9 > 128:
            assert 'error' in record
            continue
        digest = int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'little', signed=True)
        alone = gpt2_tf.sample_sequence(model, 10, context=ids, top_k=40,
                                        seed=np.array([[7, digest]], np.int64))[0, len(ids):]  # the README's seed
        assert record['tokens'] == alone.tolist(), key
        assert record['text'] == gpt2_tf.decode(alone)


def test_jsonl_input_keeps_its_keys(tmp_path):
    path = tmp_path / 'in.jsonl'
    path.write_text('\n'.join(json.dumps({'key': f'doc-{i}', 'text': f'Hello number {i}'}) for i in range(5)) + '\n')
    by_key, _ = run('score', tmp_path, path)
    assert sorted(by_key) == [f'doc-{i}' for i in range(5)]


def test_bad_lines_become_error_records_and_keys_may_repeat(tmp_path, model):
    folder = tmp_path / 'in'
    folder.mkdir()
    texts = ['Hello there friend', 'Completely other words', 'Para one.\u2028Para two.']
    lines = [json.dumps({'key': key, 'text': text}, ensure_ascii=False) for key, text in zip(['dup', 'dup', 'ls'], texts)]
    lines += ['{not json', '["x"]', '{"key": "null", "text": null}']
    (folder / 'in.jsonl').write_text('\n'.join(lines) + '\n', encoding='utf-8')
    (folder / 'in.txt').write_bytes(b'page one\x0cpage two\r\ncaf\xe9 bad\nlast line\n')
    _, records = run('score', tmp_path, str(folder / '*'))
    scored = lambda text: [float(x) for x in gpt2_tf.score(model, [gpt2_tf.encode(text)])[0]]  # noqa: E731
    dup = sorted(r['log_probs'] for r in records if r['key'] == 'dup')
    np.testing.assert_allclose(dup[0], sorted([scored(texts[0]), scored(texts[1])])[0], atol=1e-4)
    np.testing.assert_allclose(dup[1], sorted([scored(texts[0]), scored(texts[1])])[1], atol=1e-4)
    by_key = {r['key']: r for r in records if r['key'] != 'dup'}
    assert by_key['ls']['tokens'] == len(gpt2_tf.encode(texts[2])) - 1  # U+2028 is text, not a line break
    assert by_key[f'{folder}/in.jsonl:4']['error'].startswith('not JSON')
    assert by_key[f'{folder}/in.jsonl:5']['error'].startswith('not a JSON object but list')
    assert by_key['null']['error'] == '"text" must be a string, got null'
    assert by_key[f'{folder}/in.txt:1']['tokens'] == len(gpt2_tf.encode('page one\x0cpage two')) - 1
    assert by_key[f'{folder}/in.txt:2']['error'].startswith('not UTF-8 text')
    assert by_key[f'{folder}/in.txt:3']['tokens'] == len(gpt2_tf.encode('last line')) - 1
    assert len(records) == 9


# --- the checks, without a pipeline ------------------------------------------------------------

def test_tokenize_refuses_by_the_librarys_window_rule_at_its_exact_boundary():
    tokenize = Tokenize(bundled_checkpoint(), 'generate', 10)
    tokenize.setup()
    assert tokenize.hparams.n_ctx == 128
    tokenize.check([1] * 119)  # 119 + 10 - 1 = 128 = n_ctx: fits
    with pytest.raises(GPT2Error, match=r'120 tokens \+ length 10 exceeds the window by 1'):
        tokenize.check([1] * 120)
    with pytest.raises(GPT2Error, match=r'token id 50257 is outside the vocabulary \[0, 50257\)'):
        tokenize.check([1, 50257])
    with pytest.raises(GPT2Error, match='empty prompt'):
        tokenize.check([])


def test_bad_options_are_refused_when_the_handler_is_made(capsys):
    with pytest.raises(GPT2Error, match=r'top_p must be in \[0, 1\]'):
        GPT2ModelHandler(bundled_checkpoint(), 'generate', top_p=1.5)
    with pytest.raises(GPT2Error, match='length 129 is longer than the window'):
        GPT2ModelHandler(bundled_checkpoint(), 'generate', length=129)
    with pytest.raises(GPT2Error, match=r'stride must be an integer in \[1, 127\]'):
        GPT2ModelHandler(bundled_checkpoint(), 'score', stride=0)
    with pytest.raises(GPT2Error, match='seed 18446744073709551616 is out of range'):
        GPT2ModelHandler(bundled_checkpoint(), 'generate', seed=2 ** 64)
    args = ['generate', '--model_dir', bundled_checkpoint(), '--input', __file__, '--output', 'y']
    assert main(args + ['--top_k', '-1']) == 2  # before any pipeline is built
    assert 'top_k must be an integer >= 0' in capsys.readouterr().err
    for missing in ('no-such-file.txt', 'no-such-*.txt'):
        assert main(['score', '--model_dir', 'test', '--input', missing, '--output', 'y']) == 2
        assert capsys.readouterr().err.strip() == f'gpt2_tf.beam: error: {missing}: no files match it; give a file or glob'


def test_the_handler_takes_a_model_name_as_every_command_does():
    assert os.path.samefile(GPT2ModelHandler('test', 'generate', length=8).model_dir, bundled_checkpoint())
    with pytest.raises(GPT2Error, match="'no-such-model' is not a model name"):
        GPT2ModelHandler('no-such-model', 'score')


def test_batches_pad_to_powers_of_two_rows():
    assert [len(_padded([[n]] * n)) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


# --- encode: the token file encode_corpus writes ------------------------------------------------------

def test_encode_pipeline_writes_encode_corpus_s_token_file_byte_for_byte(tmp_path):
    from gpt2_tf import corpus
    from test_corpus import SEPARATED, texts, write_folder

    write_folder(tmp_path / 'in', texts() + ['line one\r\nline two\r\n', '', 'x' * 3000, SEPARATED,
                                         '\ufeffled by a byte-order mark'])
    (tmp_path / 'in' / 'skipped.md').write_text('not matched by the glob')
    expected = corpus.encode_corpus([tmp_path / 'in'], tmp_path / 'expected.bin')
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.beam', 'encode', '--input', str(tmp_path / 'in'),
                           '--output', str(tmp_path / 'beam.bin'), '--runner', 'DirectRunner',
                           '--direct_running_mode', 'multi_processing', '--direct_num_workers', '2'],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / 'beam.bin').read_bytes() == (tmp_path / 'expected.bin').read_bytes()
    assert json.loads((tmp_path / 'beam.bin.json').read_text()) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ['beam.bin', 'beam.bin.json', 'expected.bin',
                                                         'expected.bin.json', 'in']


def test_encode_pipeline_that_fails_leaves_no_token_file(tmp_path):
    (tmp_path / 'in').mkdir()
    (tmp_path / 'in' / 'a.txt').write_text('fine text')
    (tmp_path / 'in' / 'b.txt').write_bytes(b'caf\xe9 is latin-1')
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.beam', 'encode', '--input', str(tmp_path / 'in'),
                           '--output', str(tmp_path / 'out.bin')], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"gpt2_tf.beam: error: {tmp_path / 'in' / 'b.txt'}: not UTF-8 text (invalid continuation byte at byte 3); "
        f"convert it to UTF-8 or leave it out [while running 'Encode']")
    assert 'Traceback' not in done.stderr, done.stderr  # Beam's log of the step's error is left out
    assert sorted(p.name for p in tmp_path.iterdir()) == ['in']
    assert main(['encode', '--input', str(tmp_path / 'nowhere*'), '--output', str(tmp_path / 'x.bin')]) == 2


BATCHES = []  # the batch sizes a RecordingHandler saw (the DirectRunner in one process shares this module)


class RecordingHandler(GPT2ModelHandler):
    def load_model(self):
        return None

    def run_inference(self, batch, model, inference_args=None):
        BATCHES.append(len(batch))
        return [{'key': element['key']} for element in batch]


def test_run_inference_takes_full_batches_as_a_plain_loop_does():
    import apache_beam as beam
    from apache_beam.ml.inference.base import RunInference
    from apache_beam.options.pipeline_options import PipelineOptions

    BATCHES.clear()
    with beam.Pipeline(options=PipelineOptions(['--direct_running_mode', 'in_memory'])) as p:
        (p | beam.Create([{'key': str(i), 'ids': [1, 2, 3]} for i in range(43)])
         | RunInference(RecordingHandler(bundled_checkpoint(), 'score')))
    # 43 = 5 * 8 + 3: full batches, the one short batch last (left to itself, BatchElements sends ones and twos)
    assert sorted(BATCHES, reverse=True) == [8] * 5 + [3], BATCHES


def test_direct_runner_workers_on_this_machine_share_its_cores():
    from apache_beam.options.pipeline_options import PipelineOptions

    from gpt2_tf.beam import local_threads

    cores = len(os.sched_getaffinity(0))
    workers = lambda n: PipelineOptions(['--direct_running_mode', 'multi_processing', '--direct_num_workers', n])  # noqa: E731
    assert local_threads(workers('2')) == max(1, cores // 2)
    assert local_threads(workers(str(cores * 4))) == 1
    assert local_threads(PipelineOptions([])) is None  # one process: TensorFlow's own choice
    assert local_threads(PipelineOptions(['--runner', 'DataflowRunner'])) is None  # workers of their own


def test_one_save_of_a_folder_is_the_one_the_pipeline_loads_with_the_folders_vocabulary(tmp_path):
    import shutil

    from gpt2_tf.assets import bundled_vocabulary

    folder = tmp_path / 'run1'
    shutil.copytree(bundled_checkpoint(), folder)
    model = gpt2_tf.load_model(folder)
    gpt2_tf.save_checkpoint(model, folder, name='model-2', keep=2)
    model.wte.assign(model.wte * 2)
    gpt2_tf.save_checkpoint(model, folder, name='model-4', keep=2)  # the current save
    vocab = json.loads(open(bundled_vocabulary()[0], encoding="utf-8").read())
    vocab['!'], vocab['"'] = vocab['"'], vocab['!']  # the folder's own vocabulary
    (folder / 'encoder.json').write_text(json.dumps(vocab), encoding='utf-8')
    shutil.copy(bundled_vocabulary()[1], folder / "vocab.bpe")
    loaded = GPT2ModelHandler(str(folder / 'model-2'), 'score').load_model()
    np.testing.assert_array_equal(loaded.model.wte.numpy(), gpt2_tf.load_model(folder / 'model-2').wte.numpy())
    assert not np.array_equal(loaded.model.wte.numpy(), gpt2_tf.load_model(folder).wte.numpy())
    assert loaded.encoder.encode('!') == [1]  # the folder's, not GPT-2's bundled one
    assert gpt2_tf.encoder.encoder_for(folder / 'model-2').encode('!') == [1]


@pytest.mark.parametrize('argv, message', [
    (['generate', '--lenght', '5'], 'unrecognized --lenght (did you mean --length?)'),
    (['score', '--temprature=0.5'], 'unrecognized --temprature (did you mean --temperature?)'),
    (['score', '--temperature', '7'], '--temperature is for generate; score does not read it'),
    (['generate', '--stride', '8'], '--stride is for score; generate does not read it'),
    (['score', '--glob', '*.md'], '--glob is for encode; score does not read it'),
])
def test_a_misspelled_option_or_one_of_another_task_is_refused_before_the_job(tmp_path, capsys, argv, message):
    from gpt2_tf.beam import main

    (tmp_path / 'prompts.txt').write_text('Hello\n')
    task, *rest = argv
    assert main([task, '--model_dir', 'test', '--input', str(tmp_path / 'prompts.txt'), '--output',
                 str(tmp_path / 'out'), *rest]) == 2
    assert capsys.readouterr().err.strip() == f'gpt2_tf.beam: error: {message}'
    assert sorted(os.listdir(tmp_path)) == ['prompts.txt']


def test_encode_pipeline_refuses_inputs_without_text_as_encode_corpus_does(tmp_path, capsys):
    (tmp_path / 'blank.txt').write_text('\n\n<|endoftext|>\n')
    status = main(['encode', '--input', str(tmp_path / 'blank.txt'), '--output', str(tmp_path / 'out.bin')])
    assert status == 2, capsys.readouterr().err
    err = capsys.readouterr().err.strip()  # one line; the runner names the step it failed in
    assert err.startswith('gpt2_tf.beam: error: no text in ') and '\n' not in err
    assert 'blank.txt: nothing to encode (empty documents are left out)' in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['blank.txt']
    (tmp_path / 'text.txt').write_text('Some text.')  # encode's rule for --model_dir: its own vocabulary or none
    assert main(['encode', '--input', str(tmp_path / 'text.txt'), '--output', str(tmp_path / 'out.bin'),
                 '--model_dir', str(tmp_path / 'no-such-folder')]) == 2
    assert capsys.readouterr().err.strip() == (
        f'gpt2_tf.beam: error: {tmp_path / "no-such-folder"} has no vocabulary files (encoder.json and vocab.bpe, or '
        f'vocab.json and merges.txt); leave out --model_dir to encode with the bundled GPT-2 vocabulary')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['blank.txt', 'text.txt']


class Mounted(LocalFileSystem):
    """Beam's file system for mounted://PATH: this machine's PATH, read as Beam reads gs:// or s3:// paths."""

    @classmethod
    def scheme(cls):
        return 'mounted'

    def match(self, patterns, limits=None):
        return super().match([p.removeprefix('mounted://') for p in patterns], limits)

    def open(self, path, *args, **kwargs):
        return super().open(path.removeprefix('mounted://'), *args, **kwargs)


def test_a_model_folder_on_beams_file_systems_is_copied_to_each_worker(tmp_path, model, capsys):
    path = tmp_path / 'texts.txt'
    path.write_text('the cat sat on the mat\nand then ran home\n')
    folder = tmp_path / 'model'  # the bundled checkpoint with its vocabulary beside it, as a download holds them
    shutil.copytree(bundled_checkpoint(), folder)
    for vocabulary in bundled_vocabulary():
        shutil.copy(vocabulary, folder)
    remote = f'mounted://{folder}'
    assert main(['score', '--model_dir', remote, '--input', str(path), '--output', str(tmp_path / 'out' / 'p')]) == 0
    records = [json.loads(line) for f in sorted(glob.glob(str(tmp_path / 'out' / 'p*.jsonl'))) for line in open(f)]
    for record, line in zip(sorted(records, key=lambda r: r['key']), ['the cat sat on the mat', 'and then ran home']):
        expected = gpt2_tf.score(model, [gpt2_tf.encode(line)])[0]
        assert np.abs(np.array(record['log_probs']) - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
    assert main(['encode', '--input', str(path), '--output', str(tmp_path / 'remote.bin'), '--model_dir', remote]) == 0
    gpt2_tf.corpus.encode_corpus([path], tmp_path / 'local.bin')
    assert (tmp_path / 'remote.bin').read_bytes() == (tmp_path / 'local.bin').read_bytes()
    capsys.readouterr()
    for model_dir, message in [(f'mounted://{tmp_path / "none"}', f'mounted://{tmp_path / "none"}: no model files '
                                                                  f'there; give a model folder'),
                               ('nowhere://bucket/124M', 'nowhere://bucket/124M/*: Unable to get filesystem from '
                                                         'specified path')]:
        assert main(['score', '--model_dir', model_dir, '--input', str(path), '--output', str(tmp_path / 'x')]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f'gpt2_tf.beam: error: {message}') and '\n' not in err, err
    assert main(['score', '--model_dir', 'test', '--input', 'nowhere://bucket/*.txt', '--output', 'o']) == 2
    assert 'error: nowhere://bucket/*.txt: Unable to get filesystem' in capsys.readouterr().err
    bare = f'mounted://{bundled_checkpoint()}'  # a model folder without vocabulary files: named as given
    assert main(['encode', '--input', str(path), '--output', str(tmp_path / 'x.bin'), '--model_dir', bare]) == 2
    assert capsys.readouterr().err.startswith(f'gpt2_tf.beam: error: {bare} has no vocabulary files')



def test_a_join_retried_after_it_finished_returns_its_result(tmp_path):
    from gpt2_tf import corpus
    from gpt2_tf.beam import join_shards

    (tmp_path / 'shards').mkdir()
    ids = [[464, 3797, 50256], [15496, 50256]]
    shards = []
    for index, row in enumerate(ids):
        (tmp_path / 'shards' / f'{index}.bin').write_bytes(np.array(row, '<u2').tobytes())
        shards.append((index, str(tmp_path / 'shards' / f'{index}.bin'), len(row), 1))
    output = str(tmp_path / 'out.bin')
    first = join_shards(shards, output=output, model_dir=None, inputs=['a', 'b'])
    assert not list((tmp_path / 'shards').iterdir())  # the shards go once the output is in place
    again = join_shards(shards, output=output, model_dir=None, inputs=['a', 'b'])  # as a runner's retry would
    assert again == first == json.loads((tmp_path / 'out.bin.json').read_text())
    assert np.asarray(corpus.read_tokens(output)).tolist() == ids[0] + ids[1]
