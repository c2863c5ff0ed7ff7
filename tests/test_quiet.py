"""Quiet as a library and on the command line: nothing on stderr but what the caller asked for."""

import os
import subprocess
import sys

LIBRARY = '''
import numpy as np
import gpt2_tf

model = gpt2_tf.load_model('test')
ids = gpt2_tf.encode("Hello, I'm a language model,")
model(np.array([ids], np.int32))
for length in (3, 5, 9, 17):  # several shapes, as a program makes them
    gpt2_tf.sample_sequence(model, length, context=ids, batch_size=2, top_k=40, seed=1)
    gpt2_tf.score(model, [ids[:length % 7 + 2]], top=2)
gpt2_tf.generate(model, 'Hello', 4, nsamples=2, seed=1)
gpt2_tf.perplexity(model, ids * 20, stride=64)
gpt2_tf.score_completion(model, ids, gpt2_tf.encode(' yes'))
gpt2_tf.save_checkpoint(model, 'saved')
gpt2_tf.load_model('saved')
print('done')
'''


def env(**extra) -> dict:
    values = dict(os.environ)
    values.pop('TF_CPP_MIN_LOG_LEVEL', None)  # what a user's shell has
    values.update(extra)
    return values


def test_the_library_prints_nothing_it_was_not_asked_to(tmp_path):
    done = subprocess.run([sys.executable, '-c', LIBRARY], cwd=tmp_path, capture_output=True, text=True, env=env(),
                          timeout=300)
    assert done.returncode == 0 and done.stdout == 'done\n', done.stderr
    assert done.stderr == ''


def test_a_program_that_configures_tensorflow_keeps_its_settings(tmp_path):
    script = ('import logging, sys; logging.getLogger("tensorflow").setLevel(logging.INFO); import gpt2_tf; '
              'gpt2_tf.load_model("test"); print(logging.getLogger("tensorflow").level, '
              '[type(f).__name__ for f in sys.meta_path if "Quiet" in type(f).__name__])')
    done = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, capture_output=True, text=True, env=env(),
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == '20 []', done.stderr  # INFO kept; the hook gone
    chosen = subprocess.run([sys.executable, '-c', 'import gpt2_tf, sys; import tensorflow; '
                             'print(type(sys.modules["tensorflow"].__spec__.loader).__name__)'],
                            cwd=tmp_path, capture_output=True, text=True, env=env(TF_CPP_MIN_LOG_LEVEL='0'),
                            timeout=300)
    assert chosen.returncode == 0 and 'Quiet' not in chosen.stdout, chosen.stdout
    assert 'oneDNN' in chosen.stderr or 'cuda' in chosen.stderr.lower()  # the program asked for TensorFlow's lines


def test_encode_loads_no_tensorflow(tmp_path):
    (tmp_path / 'corpus.txt').write_text('Hello world. ' * 100)
    command = [sys.executable, '-m', 'gpt2_tf.cli', 'encode', 'corpus.txt', 'out.npz']
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0 and done.stderr == '', done.stderr
    assert done.stdout == 'out.npz: 302 tokens\n'  # 3 per sentence, the last space, then <|endoftext|>
    timed = subprocess.run([sys.executable, '-X', 'importtime', *command[1:]], cwd=tmp_path, capture_output=True,
                           text=True, env=env(), timeout=120)
    imported = {line.rsplit('|', 1)[-1].strip() for line in timed.stderr.splitlines() if '|' in line}
    assert 'gpt2_tf.cli' in imported and 'tensorflow' not in imported


ONEDNN = ('import os, sys; {imports}; from tensorflow.python.util import _pywrap_util_port as port; '
          'print(os.environ.get("TF_ENABLE_ONEDNN_OPTS"), port.IsMklEnabled())')


def onednn(imports: str, **extra) -> str:
    values = {k: v for k, v in env(**extra).items() if k != 'TF_ENABLE_ONEDNN_OPTS' or 'TF_ENABLE_ONEDNN_OPTS' in extra}
    done = subprocess.run([sys.executable, '-c', ONEDNN.format(imports=imports)], capture_output=True, text=True,
                          env=values, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_tensorflow_loaded_through_gpt2_tf_has_onednn_on_on_every_cpu():
    # TensorFlow itself leaves oneDNN off on AVX2-only CPUs, where it made forward passes and training faster.
    assert onednn('import gpt2_tf; import tensorflow') == '1 True'
    assert onednn('import gpt2_tf; import tensorflow', TF_CPP_MIN_LOG_LEVEL='2') == '1 True'  # not quiet, still on
    assert onednn('from gpt2_tf import quiet; quiet.tensorflow()') == '1 True'  # the command line's import
    assert onednn('from gpt2_tf import quiet; quiet.tensorflow(onednn=False)') == '0 False'
    assert onednn('import gpt2_tf; import tensorflow', TF_ENABLE_ONEDNN_OPTS='0') == '0 False'  # the user's choice


XLA_CACHE = '''
import os, sys, time
from gpt2_tf import quiet
assert 'tensorflow' not in sys.modules
folder = quiet.xla_cache_folder()
if folder is None:
    print('off', quiet.use_xla_cache(), os.environ.get('TF_XLA_FLAGS'))
    sys.exit()
os.makedirs(folder)
for i in range(5):  # 100 bytes each, the oldest first
    with open(os.path.join(folder, f'entry{i}'), 'wb') as f:
        f.write(b'x' * 100)
    os.utime(os.path.join(folder, f'entry{i}'), (1000 + i, 1000 + i))
quiet.XLA_CACHE_LIMIT = 300
print(quiet.use_xla_cache() == folder, sorted(os.listdir(folder)), quiet.xla_cache_on())
'''


def test_the_xla_cache_keeps_its_newest_files_under_the_cap_and_turns_off(tmp_path):
    done = subprocess.run([sys.executable, '-c', XLA_CACHE], capture_output=True, text=True, timeout=120,
                          env=env(GPT2_TF_XLA_CACHE=str(tmp_path / 'xla'), TF_XLA_FLAGS=''))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split('\n')[0] == "True ['entry2', 'entry3', 'entry4'] True"  # the two oldest went
    done = subprocess.run([sys.executable, '-c', XLA_CACHE], capture_output=True, text=True, timeout=120,
                          env=env(GPT2_TF_XLA_CACHE='off', TF_XLA_FLAGS=''))
    assert done.stdout.split('\n')[0] == 'off None ', done.stderr  # nothing set in TF_XLA_FLAGS


def test_ctrl_c_while_tensorflow_loads_shows_none_of_its_lines(capfd):
    import pytest

    from gpt2_tf import quiet

    def load(error):
        os.write(2, b'I0000 a start-up line\n')
        raise error

    with pytest.raises(KeyboardInterrupt):
        quiet._start(lambda: load(KeyboardInterrupt()))
    assert capfd.readouterr().err == ''
    with pytest.raises(ImportError):
        quiet._start(lambda: load(ImportError('a broken install')))
    assert 'a start-up line' in capfd.readouterr().err  # a failed import shows them


def test_the_xla_cache_goes_to_a_folder_with_spaces_in_its_name(tmp_path):
    # TF_XLA_FLAGS is split at whitespace: unquoted, XLA wrote into tmp_path/my and left 'my cache' empty.
    script = ('from gpt2_tf import quiet; tf = quiet.tensorflow(); '
              'tf.function(lambda x: x * 2, jit_compile=True)(tf.ones(3))')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env(GPT2_TF_XLA_CACHE=str(tmp_path / 'my "cache"'), TF_XLA_FLAGS=''))
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.glob('my "cache"/*/*.pb')) and sorted(os.listdir(tmp_path)) == ['my "cache"']


def test_the_xla_cache_setting_reads_on_words_as_the_default_folder_and_expands_a_tilde(monkeypatch, tmp_path):
    from gpt2_tf import quiet

    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    monkeypatch.chdir(tmp_path)
    for value in ('on', 'ON', '1', 'true', ' yes ', ''):  # the words that turn GPT2_TF_KERNELS on
        monkeypatch.setenv(quiet.XLA_CACHE_ENV, value)
        assert os.path.dirname(quiet.xla_cache_folder()) == str(tmp_path / 'xdg' / 'gpt2_tf' / 'xla'), value
    monkeypatch.setenv(quiet.XLA_CACHE_ENV, '~/xla')
    assert os.path.dirname(quiet.xla_cache_folder()) == str(tmp_path / 'home' / 'xla')


def test_ctrl_c_while_tensorflow_loads_is_an_interrupt_whatever_its_import_makes_of_it(capfd, monkeypatch):
    # TensorFlow's import turned a KeyboardInterrupt raised inside it into an AttributeError, 3 times in 40.
    import signal
    import types

    import pytest

    from gpt2_tf import quiet

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    devices = types.SimpleNamespace(list_physical_devices=lambda: [])
    monkeypatch.setitem(sys.modules, 'tensorflow', types.SimpleNamespace(config=devices))
    finished = []

    def load(error=None):
        os.write(2, b'I0000 a start-up line\n')
        try:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, mid-way through the import
        except KeyboardInterrupt:
            raise AttributeError("'tuple' object has no attribute '_type_spec'") from None
        if error:
            raise error
        finished.append(True)

    for error in (None, AttributeError("'tuple' object has no attribute '_type_spec'")):
        with pytest.raises(KeyboardInterrupt):
            quiet._start(lambda: load(error))
        assert capfd.readouterr().err == ''  # no start-up lines, no traceback
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C raises again
    assert finished == [True]  # the import went on to its end
