"""Checkpoint I/O: verification before assignment, clear errors, and saving in the original format."""

import errno
import os
import pathlib
import shutil

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import CheckpointError, HParams
from gpt2_tf.checkpoint import checkpoint_shapes, find_checkpoint
from gpt2_tf.loading import resolve
from gpt2_tf.tf1_reference import Reference
from support import write_random_checkpoint

from conftest import FIXTURES, assert_close

TINY = FIXTURES / 'tf1-tiny'
BUNDLED = pathlib.Path(resolve('test').path)


@pytest.fixture
def tiny_copy(tmp_path):
    folder = tmp_path / 'tiny'
    shutil.copytree(TINY, folder)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


def test_checkpoint_found_by_folder_or_prefix(tiny_copy):
    assert find_checkpoint(tiny_copy) == str(tiny_copy / 'model.ckpt')
    assert find_checkpoint(tiny_copy / 'model.ckpt') == str(tiny_copy / 'model.ckpt')


def test_checkpoint_file_with_a_relative_path_into_a_subfolder(tiny_copy):
    (tiny_copy / 'inner').mkdir()
    for f in ('model.ckpt.index', 'model.ckpt.data-00000-of-00001'):
        (tiny_copy / f).rename(tiny_copy / 'inner' / f)
    (tiny_copy / 'checkpoint').write_text('model_checkpoint_path: "inner/model.ckpt"\n')
    assert find_checkpoint(tiny_copy) == str(tiny_copy / 'inner' / 'model.ckpt')  # as TF's latest_checkpoint


def test_checkpoint_file_with_a_foreign_absolute_path(tiny_copy):
    (tiny_copy / 'checkpoint').write_text('model_checkpoint_path: "/home/someone/run1/model.ckpt"\n')
    assert find_checkpoint(tiny_copy) == str(tiny_copy / 'model.ckpt')


@pytest.mark.parametrize('written, meant', [
    (r'C:\\Users\\someone\\run1\\model.ckpt', 'C:\\Users\\someone\\run1\\model.ckpt'),  # backslashes escaped, as TF writes them
    (r'D:\\caf\303\251\\model.ckpt', 'D:\\café\\model.ckpt'),  # a non-ASCII folder, octal-escaped by older protobufs
    ('C:/Users/someone/run1/model.ckpt', 'C:/Users/someone/run1/model.ckpt'),
])
def test_checkpoint_file_with_a_windows_path(tiny_copy, written, meant):
    (tiny_copy / 'checkpoint').write_text(f'model_checkpoint_path: "{written}"\nall_model_checkpoint_paths: "{written}"\n')
    assert gpt2_tf.checkpoint.read_state(str(tiny_copy)) == (meant, [meant])
    assert gpt2_tf.checkpoint.checkpoint_state(str(tiny_copy)) == ('model.ckpt', ['model.ckpt'])
    assert find_checkpoint(tiny_copy) == str(tiny_copy / 'model.ckpt')


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match='no model folder at /nonexistent/124M'):
        gpt2_tf.load_model('/nonexistent/124M')


def test_folder_without_checkpoint(tmp_path):
    shutil.copy(TINY / 'hparams.json', tmp_path)
    with pytest.raises(FileNotFoundError, match='no checkpoint in .*model.ckpt.index'):
        gpt2_tf.load_model(tmp_path)


def test_missing_hparams(tiny_copy):
    (tiny_copy / 'hparams.json').unlink()
    with pytest.raises(FileNotFoundError, match='no hparams.json'):
        gpt2_tf.load_model(tiny_copy)


def test_checkpoint_file_names_missing_files(tiny_copy):
    (tiny_copy / 'model.ckpt.index').unlink()
    with pytest.raises(FileNotFoundError, match="names checkpoint 'model.ckpt', but model.ckpt.index is not in"):
        gpt2_tf.load_model(tiny_copy)


def test_missing_data_file(tiny_copy):
    (tiny_copy / 'model.ckpt.data-00000-of-00001').unlink()
    with pytest.raises((FileNotFoundError, CheckpointError), match='model.ckpt'):
        gpt2_tf.load_model(tiny_copy)


def test_a_missing_shard_of_several_is_named(tiny_copy):
    data = tiny_copy / 'model.ckpt.data-00000-of-00001'
    data.rename(tiny_copy / 'model.ckpt.data-00001-of-00002')  # the second of two shards; the first is gone
    with pytest.raises(FileNotFoundError, match='model.ckpt.data-00000-of-00002 is missing: copy it in beside the '
                                                'other shards') as missing:
        gpt2_tf.load_model(tiny_copy)
    assert '\n' not in str(missing.value)


def test_truncated_data_file(tiny_copy):
    data = tiny_copy / 'model.ckpt.data-00000-of-00001'
    data.write_bytes(data.read_bytes()[:50_000])
    with pytest.raises(CheckpointError, match='holds 50,000 bytes but the variables need 171,520; it is truncated'):
        gpt2_tf.load_model(tiny_copy)


def test_corrupt_data_file(tiny_copy):
    data = tiny_copy / 'model.ckpt.data-00000-of-00001'
    data.write_bytes(b'\0' * data.stat().st_size)  # right size, wrong bytes: the stored checksums catch it
    with pytest.raises(CheckpointError, match='corrupt or truncated'):
        gpt2_tf.load_model(tiny_copy)


def test_corrupt_index(tiny_copy):
    (tiny_copy / 'model.ckpt.index').write_bytes(b'not an index')
    with pytest.raises(CheckpointError, match='cannot read checkpoint'):
        gpt2_tf.load_model(tiny_copy)


def test_hparams_of_another_size(tiny_copy):
    hp = HParams.from_json(tiny_copy / 'hparams.json')
    HParams(n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, n_embd=64, n_head=4, n_layer=2).to_json(tiny_copy / 'hparams.json')
    with pytest.raises(CheckpointError) as error:
        gpt2_tf.load_model(tiny_copy)
    message = str(error.value)
    assert 'model/wte: expected shape [512, 64], found [512, 32]' in message
    assert 'checkpoint looks like n_vocab=512, n_embd=32, n_ctx=32, n_layer=2' in message
    assert 'hparams.json describes another model size' in message


def test_missing_and_extra_variables(tiny_copy, tmp_path):
    # A checkpoint with one block fewer than hparams.json says: h1 is missing.
    hp = HParams.from_json(tiny_copy / 'hparams.json')
    one_layer = HParams(n_vocab=hp.n_vocab, n_ctx=hp.n_ctx, n_embd=hp.n_embd, n_head=hp.n_head, n_layer=1)
    write_random_checkpoint(tmp_path / 'short', one_layer)
    hp.to_json(tmp_path / 'short' / 'hparams.json')
    with pytest.raises(CheckpointError, match=r'model/h1/attn/c_attn/w: missing from the checkpoint \(expected shape \[1, 32, 96\]\)'):
        gpt2_tf.load_model(tmp_path / 'short')
    # hparams.json with one block fewer than the checkpoint: h1 is extra.
    one_layer.to_json(tiny_copy / 'hparams.json')
    with pytest.raises(CheckpointError, match=r'12 variable\(s\) the model does not have: model/h1/'):
        gpt2_tf.load_model(tiny_copy)
    # strict=False passes over extra variables, not over a block past n_layer: that is another model size.
    with pytest.raises(CheckpointError, match=r'n_layer=2\). Likely cause: hparams.json describes another model size'):
        gpt2_tf.load_model(tiny_copy, strict=False)


def write_with(folder, add=None, drop=(), source=TINY):
    """source's checkpoint written again at folder with tensors added ({name: array}) or dropped."""
    model = gpt2_tf.load_model(source)
    tensors = {n: v.read_value() for n, v in model.variables_by_name().items() if n not in drop}
    folder.mkdir()
    gpt2_tf.checkpoint.write_tensors(str(folder / 'model.ckpt'), {**tensors, **(add or {})})
    (folder / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    shutil.copy(source / 'hparams.json', folder)
    return model


def test_a_variable_missing_at_the_right_size_is_not_blamed_on_the_size(tmp_path):
    write_with(tmp_path / 'short', drop=['model/h1/ln_2/g'])
    with pytest.raises(CheckpointError) as error:
        gpt2_tf.load_model(tmp_path / 'short')
    first, *rest = str(error.value).splitlines()
    assert first.endswith('does not match the model: 1 of its variable(s) are missing from the checkpoint '
                          '(model/h1/ln_2/g); it is incomplete or not a GPT-2 checkpoint: copy or download it again.')
    assert rest == ['  model/h1/ln_2/g: missing from the checkpoint (expected shape [32])']
    assert 'another model size' not in str(error.value)


def test_optimizer_slots_name_strict_false_on_the_first_line(tmp_path, capsys):
    slots = {'beta1_power': tf.constant(0.9), 'model/h0/attn/c_attn/w/Adam': tf.zeros([1, 16, 48]),
             'model/h0/attn/c_attn/w/Adam_1': tf.zeros([1, 16, 48])}
    model = write_with(tmp_path / 'adam', add=slots, source=BUNDLED)  # GPT-2's vocabulary, for the command line
    with pytest.raises(CheckpointError) as error:
        gpt2_tf.load_model(tmp_path / 'adam')
    first = str(error.value).splitlines()[0]
    assert ('the checkpoint holds 3 variable(s) the model does not have (beta1_power, model/h0/attn/c_attn/w/Adam, '
            'model/h0/attn/c_attn/w/Adam_1); if they are optimizer slots or other training state, load with '
            'strict=False (--no_strict on the command line) to ignore them.') in first
    assert 'another model size' not in str(error.value)
    loaded = gpt2_tf.load_model(tmp_path / 'adam', strict=False)
    for name, variable in model.variables_by_name().items():
        np.testing.assert_array_equal(loaded.variables_by_name()[name].numpy(), variable.numpy(), name)
    # The command line shows that first line, and takes --no_strict.
    from gpt2_tf.cli import main

    argv = ['sample', '--model_dir', str(tmp_path / 'adam'), '--length', '3', '--nsamples', '1', '--seed', '1',
            '--mode', 'eager']
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith('(--no_strict on the command line) to ignore them.')
    assert main(argv + ['--no_strict']) == 0
    assert capsys.readouterr().out.count('SAMPLE 1') == 1
    compare = ['compare', str(tmp_path / 'adam'), '--tokens', '1 2 3']  # the port loads it, the TF1 graph too
    assert main(compare) == 2 and '--no_strict' in capsys.readouterr().err
    assert main(compare + ['--no_strict']) == 0
    assert 'all states within tolerance' in capsys.readouterr().out
    assert main(['inspect', str(tmp_path / 'adam')]) == 2  # accounting lists them
    assert capsys.readouterr().err.strip().endswith('1 problem(s) against hparams.json, the first: 3 checkpoint '
                                                    'variable(s) outside the model: beta1_power, '
                                                    'model/h0/attn/c_attn/w/Adam, model/h0/attn/c_attn/w/Adam_1 '
                                                    '(training state, or a head GPT-2 does not have? the commands '
                                                    'that load it pass over it with --no_strict)')


def test_nothing_assigned_when_a_read_fails(tiny_copy):
    model = gpt2_tf.Model(HParams.from_json(tiny_copy / 'hparams.json'))  # fresh: gains 1, the rest 0
    before = {n: v.numpy().copy() for n, v in model.variables_by_name().items()}
    data = tiny_copy / 'model.ckpt.data-00000-of-00001'
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 64] = b'\x55' * 64  # same size: passes the size check, fails a checksum
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match='corrupt or truncated'):
        gpt2_tf.checkpoint.restore(model, tiny_copy)
    for name, variable in model.variables_by_name().items():
        np.testing.assert_array_equal(variable.numpy(), before[name], name)


def test_truncated_data_with_extra_variables_is_a_checkpoint_error(tmp_path):
    # Extra variables (optimizer slots, say) sort first and make the file larger than the
    # model needs, so a truncated end passes the size check and fails only when read.
    model = gpt2_tf.load_model(TINY)
    tensors = {n: v.read_value() for n, v in model.variables_by_name().items()}
    tensors['aaa/slot'] = tf.zeros([20000])
    gpt2_tf.checkpoint.write_tensors(str(tmp_path / 'model.ckpt'), tensors)
    (tmp_path / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    shutil.copy(TINY / 'hparams.json', tmp_path)
    data = tmp_path / 'model.ckpt.data-00000-of-00001'
    data.write_bytes(data.read_bytes()[:-4000])
    with pytest.raises(CheckpointError, match=r'cannot read model/wte .*corrupt or truncated'):
        gpt2_tf.load_model(tmp_path, strict=False)


def test_save_then_restore_with_tf1_saver(tmp_path):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot')
    prefix = gpt2_tf.save_checkpoint(model, tmp_path / 'saved')
    assert sorted(os.listdir(tmp_path / 'saved')) == [
        'checkpoint', 'hparams.json', 'model.ckpt.data-00000-of-00001', 'model.ckpt.index']
    assert checkpoint_shapes(tmp_path / 'saved') == checkpoint_shapes(FIXTURES / 'tf1-tiny-hot')
    # The original graph restores it with tf.compat.v1.train.Saver in graph mode.
    ref = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')
    graph = Reference(model.hparams, prefix)
    assert_close(graph(ref['tokens'])['logits'], ref['logits'], 'TF1 restore of a saved model')
    # And it loads back into the port unchanged.
    again = gpt2_tf.load_model(tmp_path / 'saved')
    for name, variable in again.variables_by_name().items():
        np.testing.assert_array_equal(variable.numpy(), model.variables_by_name()[name].numpy())


def test_save_over_existing_leaves_no_temporary_files(tmp_path):
    model = gpt2_tf.load_model(TINY)
    gpt2_tf.save_checkpoint(model, tmp_path)
    gpt2_tf.save_checkpoint(model, tmp_path)
    assert not [f for f in os.listdir(tmp_path) if f.startswith('.')]


def test_saving_over_a_checkpoint_switches_prefixes_and_removes_the_old(tmp_path):
    model = gpt2_tf.load_model(TINY)
    first = gpt2_tf.save_checkpoint(model, tmp_path)
    assert first == str(tmp_path / 'model.ckpt')
    second = gpt2_tf.save_checkpoint(model, tmp_path)
    assert second == str(tmp_path / 'model.ckpt-1')
    assert not (tmp_path / 'model.ckpt.index').exists()  # the old prefix goes once the new one is named
    assert find_checkpoint(tmp_path) == second
    (tmp_path / 'notes.txt').write_text('mine')
    gpt2_tf.save_checkpoint(model, tmp_path)
    assert (tmp_path / 'notes.txt').read_text() == 'mine'  # the folder's other files stay


@pytest.mark.parametrize('fail_at', range(6))
def test_an_interrupted_save_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, fail_at):
    """Fail the save at each file operation in turn: the folder always loads, as the old or the new model."""
    old = gpt2_tf.load_model(TINY)
    gpt2_tf.save_checkpoint(old, tmp_path)
    new = gpt2_tf.load_model(TINY)
    for variable in new.variables:
        variable.assign(variable + 1)
    steps = []
    real_replace, real_remove = os.replace, os.remove

    def failing(real):
        def step(*args):
            steps.append(args)
            if len(steps) == fail_at + 1:
                raise OSError('simulated crash')
            return real(*args)
        return step

    monkeypatch.setattr(os, 'replace', failing(real_replace))
    monkeypatch.setattr(os, 'remove', failing(real_remove))
    try:
        gpt2_tf.save_checkpoint(new, tmp_path)
        completed = True
    except OSError:
        completed = False
    monkeypatch.undo()
    loaded = gpt2_tf.load_model(tmp_path)
    wte = loaded.variables_by_name()['model/wte'].numpy()
    source = new if completed or not np.array_equal(wte, old.variables_by_name()['model/wte'].numpy()) else old
    for name, variable in loaded.variables_by_name().items():
        np.testing.assert_array_equal(variable.numpy(), source.variables_by_name()[name].numpy(), name)
    if fail_at >= len(steps):
        assert completed


def test_saving_a_model_of_another_size_into_a_folder_is_refused(tmp_path):
    gpt2_tf.save_checkpoint(gpt2_tf.load_model(TINY), tmp_path)
    with pytest.raises(CheckpointError, match='holds a model of another size'):
        gpt2_tf.save_checkpoint(gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot'), tmp_path)


def test_the_index_is_moved_into_place_after_the_data(tmp_path, monkeypatch):
    """A crash between the two moves must never leave an index whose data is missing."""
    tensors = {'model/wte': tf.ones([3, 2])}
    prefix = str(tmp_path / 'model.ckpt')
    real_replace, moved = os.replace, []

    def crash_on_the_second(source, destination):
        if moved:
            raise OSError('simulated crash')
        moved.append(destination)
        return real_replace(source, destination)

    monkeypatch.setattr(os, 'replace', crash_on_the_second)
    with pytest.raises(OSError, match='simulated crash'):
        gpt2_tf.checkpoint.write_tensors(prefix, tensors)
    monkeypatch.undo()
    assert moved == [prefix + '.data-00000-of-00001']
    assert not os.path.exists(prefix + '.index')
    assert os.listdir(tmp_path) == ['model.ckpt.data-00000-of-00001']  # the staging folder is gone too



def _files(folder) -> set:
    return set(os.listdir(folder))


def test_a_full_disk_while_writing_is_an_oserror_naming_the_prefix(tmp_path, monkeypatch):
    """TensorFlow says a full disk with ResourceExhaustedError, which finetune's `except OSError` (the previous
    checkpoint is intact) and the command line's one-line error would not catch."""
    model = gpt2_tf.load_model(TINY)
    gpt2_tf.save_checkpoint(model, tmp_path)
    before = _files(tmp_path)

    def full(**_):
        raise tf.errors.ResourceExhaustedError(None, None, 'bundle.data-00000-of-00001.tempstate1; No space left')

    monkeypatch.setattr(tf.raw_ops, 'SaveV2', full)
    with pytest.raises(OSError) as raised:
        gpt2_tf.save_checkpoint(model, tmp_path)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / 'model.ckpt-1')
    assert _files(tmp_path) == before


def full_at_the_switch(monkeypatch) -> None:
    """The disk fills when the `checkpoint` file is switched: every save's files whole, none of them published."""
    real_replace = os.replace

    def full(source, destination):
        if os.path.basename(destination) == 'checkpoint':
            raise OSError(errno.ENOSPC, 'No space left on device')
        return real_replace(source, destination)

    monkeypatch.setattr(os, 'replace', full)


def test_a_save_failing_at_the_switch_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """The new prefix's files are whole but the `checkpoint` file cannot be written: they go, with the temporary
    file, instead of staying unlisted (a model's size, on a disk that is full already)."""
    model = gpt2_tf.load_model(TINY)
    gpt2_tf.save_checkpoint(model, tmp_path)
    before = _files(tmp_path)
    full_at_the_switch(monkeypatch)
    with pytest.raises(OSError, match='No space'):
        gpt2_tf.save_checkpoint(model, tmp_path)
    monkeypatch.undo()
    assert _files(tmp_path) == before
    assert gpt2_tf.save_checkpoint(model, tmp_path) == str(tmp_path / 'model.ckpt-1')


def test_a_name_already_saved_is_refused(tmp_path):
    model = gpt2_tf.load_model(TINY)
    gpt2_tf.save_checkpoint(model, tmp_path, name='best')
    with pytest.raises(CheckpointError, match='holds a checkpoint named best already.*give a new name'):
        gpt2_tf.save_checkpoint(model, tmp_path, name='best')
    assert gpt2_tf.save_checkpoint(model, tmp_path, name='better') == str(tmp_path / 'better')


def _run_folder(tmp_path, steps=(10, 20)):
    """A run folder as gpt-2-simple leaves it: model-<step> saves, the `checkpoint` file listing them."""
    folder = tmp_path / 'run1'
    folder.mkdir()
    shutil.copy(TINY / 'hparams.json', folder)
    for step in steps:
        for suffix in ('.index', '.data-00000-of-00001'):
            shutil.copy(TINY / ('model.ckpt' + suffix), folder / f'model-{step}{suffix}')
    gpt2_tf.checkpoint.write_state(str(folder), [f'model-{step}' for step in steps])
    return folder


def test_saving_into_a_run_folder_keeps_its_saves(tmp_path):
    """save_checkpoint never removes a run's saves: model-10 (a better step someone loaded to save its fine-tuned
    copy beside) and model-20 stay, listed."""
    folder = _run_folder(tmp_path)
    model = gpt2_tf.load_model(folder / 'model-10')
    first = gpt2_tf.save_checkpoint(model, folder)
    second = gpt2_tf.save_checkpoint(model, folder)
    assert find_checkpoint(folder) == second and not os.path.exists(first + '.index')
    assert gpt2_tf.checkpoint.checkpoint_state(str(folder))[1] == ['model-10', 'model-20', 'model.ckpt-1']
    for step in (10, 20):
        assert (folder / f'model-{step}.index').exists()


def test_keep_counts_saves_under_given_names(tmp_path):
    model = gpt2_tf.load_model(TINY)
    for i in range(4):
        gpt2_tf.save_checkpoint(model, tmp_path, name=f'step-{i}', keep=2)
    assert gpt2_tf.checkpoint.checkpoint_state(str(tmp_path))[1] == ['step-2', 'step-3']
    assert sorted(p.name for p in tmp_path.glob('*.index')) == ['step-2.index', 'step-3.index']


def test_a_first_save_that_fails_leaves_no_hparams_json(tmp_path, monkeypatch):
    full_at_the_switch(monkeypatch)
    with pytest.raises(OSError, match='No space'):
        gpt2_tf.save_checkpoint(gpt2_tf.load_model(TINY), tmp_path / 'new')
    assert os.listdir(tmp_path / 'new') == []


def test_a_run_s_save_failing_at_the_switch_leaves_no_optimizer_state(tmp_path, monkeypatch):
    from gpt2_tf import runfolder

    model = gpt2_tf.load_model(TINY)
    slots = {'model/wte/Adam': tf.Variable(tf.ones_like(model.variables_by_name()['model/wte']))}
    runfolder.save(str(tmp_path), model, slots, 1)
    before = _files(tmp_path)
    full_at_the_switch(monkeypatch)
    with pytest.raises(OSError, match='No space'):
        runfolder.save(str(tmp_path), model, slots, 2)
    assert _files(tmp_path) == before  # model-2 and optimizer-2 gone: step 1 as it was


def test_a_run_folder_without_its_checkpoint_file_names_its_saves(tmp_path):
    folder = _run_folder(tmp_path, steps=(9, 10))
    shutil.copy(folder / 'model-10.index', folder / 'optimizer-10.index')  # a state, not a model
    (folder / 'checkpoint').write_text('')
    with pytest.raises(CheckpointError, match=r'no model_checkpoint_path line; write the line naming the '
                                              r'checkpoint to load, or load one of its saves \(model-9, model-10\) '
                                              r'by its prefix, as .*run1/model-10$'):
        gpt2_tf.load_model(folder)
    (folder / 'checkpoint').unlink()
    with pytest.raises(FileNotFoundError, match=r'no `checkpoint` file in .*run1 to say which save is current: '
                                                r'load one of its saves \(model-9, model-10\)'):
        gpt2_tf.load_model(folder)



def test_a_failed_write_into_a_new_nested_folder_leaves_no_folders_behind(tmp_path):
    (tmp_path / 'kept').mkdir()
    with pytest.raises(KeyboardInterrupt):
        with gpt2_tf.checkpoint.whole_folder(tmp_path / 'kept' / 'a' / 'b' / 'out') as staging:
            (pathlib.Path(staging) / 'model.tflite').write_bytes(b'half')
            raise KeyboardInterrupt  # Ctrl-C during an export
    assert os.listdir(tmp_path) == ['kept'] and os.listdir(tmp_path / 'kept') == []  # one there before stays

KILLED_WRITER = """
import sys, time
from gpt2_tf.checkpoint import whole_folder
writing = whole_folder(sys.argv[1])  # held: a dropped context manager would clean up
staging = writing.__enter__()
open(staging + '/model.tflite', 'wb').write(b'half')
print(staging, flush=True)
time.sleep(600)
"""


def test_a_killed_writers_staging_beside_a_new_folder_goes_at_the_next_write(tmp_path):
    import signal
    import subprocess
    import sys

    from gpt2_tf.checkpoint import whole_folder

    writer = subprocess.Popen([sys.executable, '-c', KILLED_WRITER, str(tmp_path / 'out')], stdout=subprocess.PIPE,
                              text=True, cwd=pathlib.Path(__file__).parent.parent)
    staging = writer.stdout.readline().strip()
    writer.send_signal(signal.SIGKILL)  # as the OOM killer ends it: no cleanup runs
    writer.wait(timeout=60)
    assert os.path.isdir(staging) and os.path.dirname(staging) == str(tmp_path)
    others = [f'.out.partial-{os.getpid()}-live_123', '.out.partial-old', '.other.partial-1-x', 'mine',
              '.out.partial-2024-01-15']  # a live writer's, one without a pid, another destination's, the user's
    for name in others:  # (one named like a staging of pid 2024, but not by mkdtemp): all stay
        (tmp_path / name).mkdir()
    with whole_folder(tmp_path / 'out') as new:
        (pathlib.Path(new) / 'model.tflite').write_bytes(b'whole')
    assert (tmp_path / 'out' / 'model.tflite').read_bytes() == b'whole'
    assert sorted(os.listdir(tmp_path)) == sorted(others + ['out'])



@pytest.mark.parametrize('dtype', ['float32', 'int8'])
def test_load_model_holds_one_checkpoint_tensor_at_a_time(monkeypatch, dtype):
    import weakref

    from gpt2_tf import checkpoint

    checked, read, held = checkpoint._checked_reader, [], []

    class Counting:  # the reader, counting the tensors read earlier that are still held when the next is read
        def __init__(self, reader):
            self.reader = reader

        def get_tensor(self, name):
            held.append(sum(ref() is not None for ref in read))
            value = self.reader.get_tensor(name)
            read.append(weakref.ref(value))
            return value

    monkeypatch.setattr(checkpoint, '_checked_reader', lambda *a, **k: Counting(checked(*a, **k)))
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny', dtype=dtype)
    count = len(checkpoint.stored(model.variables_by_name()))
    assert len(held) == count and max(held) == 0  # the model plus one tensor: each let go before the next is read
    read.clear(), held.clear()
    checkpoint.restore(model, FIXTURES / 'tf1-tiny')  # restore reads them all first, then assigns
    assert held == list(range(count))
