"""One resolver for every command and load_model: each kind of folder and name, with the same errors."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import gpt2_tf
from gpt2_tf import quiet
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.cli import main
from gpt2_tf.loading import ModelNotFound, resolve


ROOT = pathlib.Path(__file__).parent.parent
GPT2_TF = [sys.executable, '-m', 'gpt2_tf.cli']


def env() -> dict:
    values = dict(os.environ)
    values.pop('TF_CPP_MIN_LOG_LEVEL', None)  # what a user's shell has
    return values


def cli(*argv, cwd=None):
    return subprocess.run([*GPT2_TF, *map(str, argv)], capture_output=True, text=True, env=env(), cwd=cwd,
                          timeout=300)


@pytest.fixture(scope='module')
def kinds(tmp_path_factory):
    """{kind: (folder, what to pass as --model_dir or MODEL_DIR)} for every kind of model this project reads."""
    root = tmp_path_factory.mktemp('kinds')
    bundled = pathlib.Path(bundled_checkpoint())
    # A gpt-2-simple run folder: its own hparams.json and checkpoint files, no vocabulary.
    run = root / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    shutil.copy(bundled / 'hparams.json', run)
    for path in bundled.glob('model.ckpt.*'):
        shutil.copy(path, run / path.name.replace('model.ckpt', 'model-5'))
    (run / 'checkpoint').write_text('model_checkpoint_path: "model-5"\nall_model_checkpoint_paths: "model-5"\n')
    (run / 'counter').write_text('5\n')
    # A published name under a models_dir.
    shutil.copytree(bundled, root / 'models' / '124M')
    hf_folder = root / 'hf'
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), hf_folder)
    bare = root / 'hf-without-vocabulary'
    shutil.copytree(hf_folder, bare)
    for name in ('vocab.json', 'merges.txt', 'tokenizer.json'):
        (bare / name).unlink()
    return {'original': (bundled, bundled), 'run': (run, run), 'hf': (hf_folder, hf_folder),
            'hf-without-vocabulary': (bare, bare), 'models_dir': (root / 'models' / '124M', root / 'models')}


def test_each_kind_resolves_without_tensorflow(kinds):
    script = ('import sys; from gpt2_tf.loading import resolve; '
              'folders = [resolve(sys.argv[1]), resolve(sys.argv[2]), resolve(sys.argv[3]), resolve("test"), '
              'resolve(model_name="124M", models_dir=sys.argv[4])]; '
              'print([(f.layout, f.names, f.hparams().n_ctx) for f in folders]); '
              'assert "tensorflow" not in sys.modules, "resolve imported TensorFlow"')
    done = subprocess.run([sys.executable, '-c', script, kinds['original'][0], kinds['run'][0], kinds['hf'][0],
                           kinds['models_dir'][1]], capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([('original', ('test-checkpoint', 'test'), 128),
                                       ('original', ('run1',), 128), ('hf', ('hf',), 128),
                                       ('original', ('test-checkpoint', 'test'), 128),
                                       ('original', ('124M',), 128)])


def test_served_names(tmp_path):
    shutil.copytree(bundled_checkpoint(), tmp_path / '117M')
    assert resolve(tmp_path / '117M').names == ('117M', '124M')  # 124M's old name, and the published one
    assert resolve(model_name='test').names == ('test-checkpoint', 'test')
    assert resolve(tmp_path / '117M').name == '117M'


def test_old_names_find_the_folder_download_model_writes(tmp_path):
    shutil.copytree(bundled_checkpoint(), tmp_path / '124M')  # what `download_model.py 117M` leaves
    for given in (dict(model_name='117M', models_dir=tmp_path), dict(model_dir='117M', models_dir=tmp_path)):
        assert resolve(**given).path == str(tmp_path / '124M'), given
    (tmp_path / '355M.partial').mkdir()
    with pytest.raises(ModelNotFound, match=r'the download of 355M is incomplete: run `python -m gpt2_tf.download '
                                            r'355M --models_dir .*` again to resume it'):
        resolve(model_name='345M', models_dir=tmp_path)
    shutil.copytree(bundled_checkpoint(), tmp_path / '117M')  # a folder of the old name is taken as it is
    assert resolve(model_name='117M', models_dir=tmp_path).path == str(tmp_path / '117M')


def test_an_hf_folder_under_a_published_name_resolves_as_its_path_does(kinds, tmp_path):
    shutil.copytree(kinds['hf'][0], tmp_path / '124M')  # config.json and model.safetensors: no download of ours
    by_name = resolve(model_name='124M', models_dir=tmp_path)
    assert (by_name.path, by_name.layout) == (str(tmp_path / '124M'), 'hf')
    assert by_name == resolve(tmp_path / '124M')
    (tmp_path / '355M').mkdir()  # an original download cut short is still named as one
    (tmp_path / '355M' / 'hparams.json').write_text('{}')
    with pytest.raises(ModelNotFound, match=r'the download in .*355M is incomplete'):
        resolve(model_name='355M', models_dir=tmp_path)


@pytest.mark.parametrize('kind', ['hf', 'run'])
def test_generate_and_score_take_hf_and_run_folders(kinds, kind, tmp_path):
    folder = kinds[kind][1]
    done = cli('generate', 'Hello', '--model_dir', folder, '--length', '3', '--seed', '1', '--mode', 'function')
    assert done.returncode == 0 and done.stderr == '' and 'SAMPLE 1' in done.stdout, done.stderr
    (tmp_path / 'text.txt').write_text('Hello there, how are you today?')
    done = cli('score', tmp_path / 'text.txt', '--model_dir', folder)
    assert done.returncode == 0 and done.stderr == '' and 'perplexity' in done.stdout, done.stderr


@pytest.mark.slow
def test_explore_and_inspect_take_an_hf_folder(kinds, tmp_path):
    folder = kinds['hf'][1]
    done = cli('explore', folder, '--prompt', 'Hello there', '-o', tmp_path / 'report.html')
    assert done.returncode == 0 and (tmp_path / 'report.html').exists(), done.stderr
    done = cli('inspect', folder)
    assert done.returncode == 0 and 'wte' in done.stdout, done.stderr


@pytest.mark.slow
def test_export_takes_an_hf_folder(kinds, tmp_path):
    done = cli('export', kinds['hf'][1], tmp_path / 'export')
    assert done.returncode == 0 and (tmp_path / 'export' / 'saved_model.pb').exists(), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize('argv', [['--model_name', 'test'], ['--model_name', '124M', '--models_dir', 'MODELS'],
                                  ['--model_dir', 'RUN']])
def test_generate_takes_every_name(kinds, argv):
    argv = [str(kinds['models_dir'][1]) if a == 'MODELS' else str(kinds['run'][1]) if a == 'RUN' else a for a in argv]
    done = cli('generate', 'Hello', *argv, '--length', '3', '--seed', '1', '--mode', 'function')
    assert done.returncode == 0 and done.stderr == '' and 'SAMPLE 1' in done.stdout, done.stderr


@pytest.mark.parametrize('command', [('generate', 'Hello', '--model_dir', 'HF', '--length', '3', '--seed', '1',
                                      '--mode', 'function'),
                                     ('convert', 'HF', 'OUT', '--to', 'original')])
def test_a_missing_vocabulary_is_one_warning_naming_what_is_used(kinds, tmp_path, command):
    done = cli(*[{'HF': kinds['hf-without-vocabulary'][1], 'OUT': tmp_path / 'out'}.get(a, a) for a in command])
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f'gpt2-tf: warning: {kinds["hf-without-vocabulary"][1]} has no '
                                        f'vocab.json/merges.txt; using the bundled GPT-2 vocabulary']


@pytest.mark.parametrize('make, message', [
    (lambda tmp: tmp / 'nothing', 'no model folder at {}'),
    (lambda tmp: (tmp / 'file').write_text('x') and tmp / 'file', '{} is a file: give a model folder'),
    (lambda tmp: (tmp / 'empty').mkdir() or tmp / 'empty',
     '{}: no hparams.json (the original layout) or config.json (a Hugging Face folder)'),
])
def test_every_command_and_load_model_give_the_same_errors(capsys, monkeypatch, tmp_path, make, message):
    path = make(tmp_path)
    expected = message.format(path)
    with pytest.raises(ModelNotFound) as raised:
        gpt2_tf.load_model(path)
    assert str(raised.value).startswith(expected)
    monkeypatch.setattr(quiet, 'tensorflow', lambda **_: pytest.fail('TensorFlow loaded before the check'))
    for argv in (['generate', 'x', '--model_dir', path], ['score', 'README.md', '--model_dir', path],
                 ['serve', '--model_dir', path], ['finetune', 'x.txt', '--model_dir', path],
                 ['explore', path, '--prompt', 'x'],
                 ['inspect', path], ['compare', path, '--tokens', '1'], ['export', path, tmp_path / 'out'],
                 ['convert', path, tmp_path / 'out', '--to', 'hf']):
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f'gpt2-tf: error: {expected}') and len(err.splitlines()) == 1, (argv, err)


def test_names_that_are_not_models(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name, message in [('125M', "'125M' is not a"), ('355M', 'no model at checkpoints/355M')]:
        with pytest.raises(ModelNotFound, match=message):
            gpt2_tf.load_model(name)
        assert main(['generate', 'x', '--model_name', name]) == 2
        assert message in capsys.readouterr().err


def test_serve_passes_every_name_of_the_model(monkeypatch, tmp_path):
    import gpt2_tf.serve

    served = {}
    monkeypatch.setattr(gpt2_tf.serve, 'check_port', lambda host, port: served.update(checked=(host, port)))
    monkeypatch.setattr(gpt2_tf.serve, 'serve', lambda model, encoder, **options: served.update(options))
    shutil.copytree(bundled_checkpoint(), tmp_path / '124M')
    assert main(['serve', '--models_dir', str(tmp_path), '--model_name', '124M', '--port', '8123']) == 0
    assert served['checked'] == ('127.0.0.1', 8123)
    assert (served['model_id'], tuple(served['aliases'])) == ('124M', ())
    assert main(['serve', '--model_name', 'test', '--served-model-name', 'mine']) == 0
    assert (served['model_id'], tuple(served['aliases'])) == ('mine', ('test-checkpoint', 'test'))


# --- importing from the folder above a clone named gpt2_tf -------------------------------------------

def test_import_from_above_a_clone_named_gpt2_tf(tmp_path):
    (tmp_path / 'gpt2_tf').symlink_to(ROOT)  # a clone in a folder named like the package
    done = subprocess.run([sys.executable, '-c', 'import gpt2_tf; print(gpt2_tf.load_model.__module__)'],
                          cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == 'gpt2_tf.loading', done.stderr
    config = (ROOT / 'pyproject.toml').read_text()
    assert 'package-dir = { "" = "." }' in config  # what makes an editable install put the clone on sys.path


def test_a_broken_hparams_json_is_one_line(tmp_path):
    shutil.copytree(bundled_checkpoint(), tmp_path / 'broken')
    (tmp_path / 'broken' / 'hparams.json').write_text('{"n_vocab": 50257, "n_ctx": 128}')
    done = cli('generate', 'Hello', '--model_dir', tmp_path / 'broken')
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"gpt2-tf: error: {tmp_path / 'broken' / 'hparams.json'}: missing key(s) "
                                        f"['n_embd', 'n_head', 'n_layer']; expected exactly "
                                        f"['n_vocab', 'n_ctx', 'n_embd', 'n_head', 'n_layer']: add them with the "
                                        f"values of the model the checkpoint holds"]
