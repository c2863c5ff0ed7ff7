"""The SavedModel export, loaded in a fresh process that imports only TensorFlow and numpy."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
import gpt2_tf.export
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES

HOT = FIXTURES / 'tf1-tiny-hot'
CONSUMER = '''
import json, sys
import numpy as np
import tensorflow as tf
loaded = tf.saved_model.load(sys.argv[1])
tokens = tf.constant(np.load(sys.argv[2]))
out = {'logits': loaded.signatures['serving_default'](tokens=tokens)['logits'].numpy().tolist(),
       'log_probs': loaded.signatures['score'](tokens=tokens)['log_probs'].numpy().tolist()}
for name, options in json.loads(sys.argv[3]).items():
    out[name] = loaded.signatures['generate'](
        tokens=tokens, length=tf.constant(options['length']), temperature=tf.constant(options['temperature']),
        top_k=tf.constant(options['top_k']), top_p=tf.constant(options['top_p']),
        seed=tf.constant(options['seed'], tf.int64))['tokens'].numpy().tolist()
assert not any(name.startswith('gpt2_tf') for name in sys.modules), 'the consumer imported gpt2_tf'
print(json.dumps(out))
'''
REQUESTS = {
    'greedy': dict(length=20, temperature=0.0, top_k=0, top_p=1.0, seed=[0, 0]),
    'seeded': dict(length=25, temperature=0.8, top_k=20, top_p=0.9, seed=[7, 3]),
    'plain': dict(length=10, temperature=1.2, top_k=0, top_p=1.0, seed=[1, 2]),
}


def xla_functions(folder) -> int:
    """How many functions in the SavedModel are marked for XLA compilation."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((pathlib.Path(folder) / 'saved_model.pb').read_bytes())
    library = proto.meta_graphs[0].graph_def.library
    return sum(1 for f in library.function if f.attr.get('_XlaMustCompile') and f.attr['_XlaMustCompile'].b)


@pytest.mark.parametrize('xla', [False, True], ids=['plain', 'xla'])
def test_the_export_matches_the_library_in_a_process_without_gpt2_tf(tmp_path, xla):
    out = tmp_path / 'export'
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'export', str(HOT), str(out), *(['--xla'] if xla else [])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (xla_functions(out) > 0) == xla  # no XLA-compiled function without --xla
    tokens = np.load(HOT / 'reference.npz')['tokens'][:, :6]
    np.save(tmp_path / 'tokens.npy', tokens)
    consumer = subprocess.run([sys.executable, '-c', CONSUMER, str(out), str(tmp_path / 'tokens.npy'),
                               json.dumps(REQUESTS)], capture_output=True, text=True, timeout=600)
    assert consumer.returncode == 0, consumer.stderr[-2000:]
    got = json.loads(consumer.stdout.splitlines()[-1])
    model = gpt2_tf.load_model(HOT)
    logits = model(tokens)['logits'].numpy()
    # Same ops; XLA fuses and reorders float32 sums, which moves results by ~1e-6 relative.
    assert np.abs(np.array(got['logits']) - logits).max() <= 1e-5 * max(1.0, np.abs(logits).max())
    lp = gpt2_tf.score(model, tokens)
    assert np.abs(np.array(got['log_probs']) - lp).max() <= 1e-5 * max(1.0, np.abs(lp).max())
    for name, options in REQUESTS.items():
        ours = gpt2_tf.sample_sequence(model, options['length'], context=tokens, temperature=options['temperature'],
                                       top_k=options['top_k'], top_p=options['top_p'], seed=tuple(options['seed']))
        np.testing.assert_array_equal(np.array(got[name]), ours, err_msg=name)


def test_saved_model_cli_shows_the_signatures(tmp_path):
    gpt2_tf.export.export_saved_model(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), tmp_path / 'e')
    cli = pathlib.Path(sys.executable).parent / 'saved_model_cli'
    done = subprocess.run([str(cli), 'show', '--all', '--dir', str(tmp_path / 'e')], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("signature_def['serving_default']", "signature_def['generate']", "signature_def['score']",
                 "inputs['top_p']", "outputs['log_probs']"):
        assert name in done.stdout


def test_a_request_past_the_window_is_refused_by_the_signature(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')  # n_ctx = 32
    gpt2_tf.export.export_saved_model(model, tmp_path / 'e')
    generate = tf.saved_model.load(str(tmp_path / 'e')).signatures['generate']
    with pytest.raises(tf.errors.InvalidArgumentError, match='prompt \\+ length - 1 must be <= n_ctx = 32'):
        generate(tokens=tf.constant([[1, 2, 3]]), length=tf.constant(31), temperature=tf.constant(1.0),
                 top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant([1, 1], tf.int64))


def test_export_refuses_a_folder_in_use(tmp_path):
    (tmp_path / 'x').write_text('mine')
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'export', str(HOT), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and 'exists and is not empty' in done.stderr
    with pytest.raises(GPT2Error, match='exists and is not empty: write into a new folder'):
        gpt2_tf.export.export_saved_model(gpt2_tf.load_model(HOT), tmp_path)
    with pytest.raises(GPT2Error, match=f'^{tmp_path / "x"} is a file, so {tmp_path / "x" / "out"} cannot be made: '
                                        f'give a folder outside it$'):
        gpt2_tf.export.export_saved_model(gpt2_tf.load_model(HOT), tmp_path / 'x' / 'out')


def test_a_failed_export_leaves_nothing_and_a_retry_works(tmp_path, monkeypatch):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    real_save = tf.saved_model.save

    def full_disk(obj, folder, **options):
        real_save(obj, folder, **options)  # everything written, then the disk fills
        raise OSError(28, 'No space left on device')

    monkeypatch.setattr(tf.saved_model, 'save', full_disk)
    with pytest.raises(OSError, match='No space left'):
        gpt2_tf.export.export_saved_model(model, tmp_path / 'e')
    assert os.listdir(tmp_path) == []  # neither the folder nor its staging
    monkeypatch.setattr(tf.saved_model, 'save', real_save)
    gpt2_tf.export.export_saved_model(model, tmp_path / 'e')
    assert 'saved_model.pb' in os.listdir(tmp_path / 'e')


@pytest.mark.parametrize('xla', [False, True], ids=['plain', 'xla'])  # XLA drops assertions: they run outside it
def test_the_signature_checks_by_the_librarys_rules_at_the_exact_boundary(tmp_path, xla):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')  # n_ctx = 32, n_vocab = 512
    gpt2_tf.export.export_saved_model(model, tmp_path / 'e', xla=xla)
    signatures = tf.saved_model.load(str(tmp_path / 'e')).signatures
    generate = signatures['generate']

    def call(tokens, length, **options):
        options = {'temperature': 1.0, 'top_k': 0, 'top_p': 1.0, **options}
        return generate(tokens=tf.constant(tokens, tf.int32), length=tf.constant(length),
                        seed=tf.constant([1, 1], tf.int64), **{k: tf.constant(v) for k, v in options.items()})

    assert call([[1, 2, 3]], 30)['tokens'].shape == (1, 33)  # 3 + 30 - 1 = 32 = n_ctx: fits
    for tokens, length, options, message in [
            ([[1, 2, 3]], 31, {}, r'prompt \+ length - 1 must be <= n_ctx = 32'),
            ([[1, 512]], 5, {}, r'token ids must be in the vocabulary \[0, 512\)'),
            ([[-1, 2]], 5, {}, r'token ids must be in the vocabulary'),
            (np.zeros([1, 0]), 5, {}, 'tokens must hold at least one token per row'),
            (np.zeros([0, 3]), 5, {}, 'tokens must hold at least one row'),
            ([[1]], 5, {'temperature': 2.5}, r'temperature must be in \[0, 2\]'),
            ([[1]], 5, {'top_p': 1.5}, r'top_p must be in \[0, 1\]'),
            ([[1]], 5, {'top_k': -1}, 'top_k must be >= 0')]:
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            call(tokens, length, **options)
    for name in ('serving_default', 'score'):
        assert signatures[name](tokens=tf.ones([1, 32], tf.int32))  # n_ctx tokens: fits
        for tokens, message in [(np.ones([1, 33]), 'tokens must hold at most n_ctx = 32 per row'),
                                ([[1, 512]], r'token ids must be in the vocabulary \[0, 512\)'),
                                (np.zeros([1, 0]), 'tokens must hold at least one token per row'),
                                (np.zeros([0, 3]), 'tokens must hold at least one row')]:
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                signatures[name](tokens=tf.constant(tokens, tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match='scoring needs at least 2 tokens per row'):
        signatures['score'](tokens=tf.constant([[5], [6]], tf.int32))  # the library's score refuses it too


def test_an_exported_generate_refuses_nan_logits_as_the_library_does(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny')
    model.ln_f.g.assign(tf.tensor_scatter_nd_update(model.ln_f.g, [[0]], [np.nan]))
    gpt2_tf.export.export_saved_model(model, tmp_path / 'e')
    generate = tf.saved_model.load(str(tmp_path / 'e')).signatures['generate']
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r'logits were not finite \(NaN or \+inf\), so no token could be drawn'):
        generate(tokens=tf.constant([[1, 2]], tf.int32), length=tf.constant(3), temperature=tf.constant(1.0),
                 top_k=tf.constant(0), top_p=tf.constant(1.0), seed=tf.constant([1, 1], tf.int64))
