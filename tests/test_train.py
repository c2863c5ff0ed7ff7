"""Fine-tuning against the original training graph (TF1 Adam and SGD), data, run folders, resumption, Ctrl-C."""

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import HParams, corpus, train
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.encoder import get_encoder
from gpt2_tf.tf1_reference import Reference, ReferenceTrainer
from gpt2_tf.dataset import Sampler, encode_dataset, load_dataset
from gpt2_tf.train import Trainer, finetune
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES, default_sigint, tolerance
from support import ended_pid

HOT = FIXTURES / 'tf1-tiny-hot'
HPARAMS = HParams.from_json(HOT / 'hparams.json')


def batches(n=6, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, HPARAMS.n_vocab, (batch, HPARAMS.n_ctx)).astype(np.int32) for _ in range(n)]


def assert_losses_match(ours, theirs):
    # Both sides compute the same float32 sums in other orders: 1e-4 relative is far above that noise
    # (measured: under 3e-6) and far below what a broken loss or update moves (>1e-2 by step 2).
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-4 * abs(b), f'step {step}: loss {a} != reference {b}'


@pytest.mark.parametrize('optimizer, accumulate, recompute, only_blocks', [
    ('adam', 1, False, False), ('adam', 2, False, False), ('adam', 1, True, False), ('adam', 1, False, True),
    ('sgd', 1, False, False), ('sgd', 2, True, True),
], ids=['adam', 'adam-accumulate2', 'adam-recompute', 'adam-blocks-only', 'sgd', 'sgd-accumulate2-recompute-blocks'])
def test_steps_equal_the_original_training_graph(optimizer, accumulate, recompute, only_blocks):
    model = gpt2_tf.load_model(HOT)
    trainer = Trainer(model, 1e-3, optimizer, accumulate, recompute, only_blocks)
    reference = ReferenceTrainer(HPARAMS, str(HOT / 'model.ckpt'), learning_rate=1e-3, optimizer=optimizer,
                                 only_train_transformer_layers=only_blocks)
    data = batches()
    # accumulate=2 takes two micro-batches per update; the reference takes the whole batch in one step.
    assert_losses_match([trainer.step(b) for b in data], [reference.step(b) for b in data])
    assert trainer.tracing_count == 1  # one compiled step, never retraced
    held_out = batches(1, 2, seed=9)[0]
    theirs = reference(held_out)
    diff = np.abs(model(held_out)['logits'].numpy() - theirs).max()
    # Not raw weights: Adam amplifies sign-flipping rounding noise on parameters whose gradient is
    # zero (the attention key bias) without changing any output. The outputs must agree.
    assert diff <= 1e-3 * max(1.0, float(np.abs(theirs).max())), diff
    if only_blocks:
        before = gpt2_tf.load_model(HOT)
        for name in ('model/wte', 'model/wpe', 'model/ln_f/g'):
            np.testing.assert_array_equal(model.variables_by_name()[name].numpy(),
                                          before.variables_by_name()[name].numpy())


@pytest.mark.parametrize('recompute, only_blocks', [(False, False), (True, False), (False, True)],
                         ids=['plain', 'recompute', 'blocks-only'])
def test_steps_on_a_long_sequence_equal_the_original_training_graph(random_checkpoint, recompute, only_blocks):
    # 1024 positions: the attention goes in parts (gpt2_tf.causal), forward and backward; blocks only, wte
    # takes no gradient and the loss goes at most 256 rows of logits at a time: 1023 rows in 4 parts of 256,
    # the last one padded (scoring.frozen_head_loss).
    hparams = HParams(n_vocab=50, n_ctx=1024, n_embd=24, n_head=3, n_layer=2)
    folder = random_checkpoint(hparams, scale=0.3)
    trainer = Trainer(gpt2_tf.load_model(folder), 1e-3, 'adam', 1, recompute, only_blocks)
    reference = ReferenceTrainer(hparams, str(folder / 'model.ckpt'), learning_rate=1e-3, optimizer='adam',
                                 only_train_transformer_layers=only_blocks)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, hparams.n_vocab, (1, hparams.n_ctx)).astype(np.int32) for _ in range(3)]
    assert_losses_match([trainer.step(b) for b in data], [reference.step(b) for b in data])


def test_recompute_changes_nothing_but_memory():
    runs = []
    for recompute in (False, True):
        model = gpt2_tf.load_model(HOT)
        trainer = Trainer(model, 1e-2, 'sgd', recompute=recompute)
        losses = [trainer.step(b) for b in batches(5)]
        runs.append((losses, {n: v.numpy() for n, v in model.variables_by_name().items()}))
    (plain, plain_weights), (recomputed, recomputed_weights) = runs
    np.testing.assert_allclose(recomputed, plain, rtol=1e-6)
    for name, value in plain_weights.items():
        # Within 1e-6 of each tensor's largest weight: a few float32 roundings of the weights
        # themselves (a recomputed activation may round differently), far below any real change.
        np.testing.assert_allclose(recomputed_weights[name], value, rtol=0, atol=1e-6 * np.abs(value).max(),
                                   err_msg=name)


@pytest.mark.parametrize('kwargs, message', [
    (dict(optimizer='rmsprop'), "optimizer must be one of \\('adam', 'sgd', 'adafactor'\\)"),
    (dict(learning_rate=0), 'learning_rate must be a finite number > 0'),
    (dict(accumulate_gradients=0), 'accumulate_gradients must be an integer >= 1'),
])
def test_bad_trainer_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trainer(gpt2_tf.load_model(HOT), **kwargs)


def test_a_batch_that_does_not_split_is_an_error():
    trainer = Trainer(gpt2_tf.load_model(HOT), accumulate_gradients=3)
    with pytest.raises(ValueError, match='batch of 4 rows does not split into accumulate_gradients=3'):
        trainer.step(batches(1)[0])


# --- data ------------------------------------------------------------------------------------------

def test_text_datasets_join_documents_with_the_end_of_text_token(tmp_path):
    encoder = get_encoder()
    (tmp_path / 'a.txt').write_text('First document.\n<|endoftext|>\nSecond one.\n')
    (tmp_path / 'b.txt').write_text('Third, in another file.\n')
    chunks = load_dataset(str(tmp_path), encoder, combine=10**9)
    expected = (encoder.encode('First document.') + [50256] + encoder.encode('Second one.') + [50256]
                + encoder.encode('Third, in another file.') + [50256])
    assert len(chunks) == 1 and chunks[0].tolist() == expected
    assert [c.tolist() for c in load_dataset(str(tmp_path / '*.txt'), encoder, combine=10**9)] == [expected]
    several = load_dataset(str(tmp_path), encoder, combine=1)  # every document its own chunk
    assert [c.tolist() for c in several][0] == encoder.encode('First document.') + [50256]


@pytest.mark.parametrize('text', [
    '<|endoftext|>\nFirst.\n<|endoftext|>\nSecond.',  # a separator on the first line
    'First.\n<|endoftext|>\nSecond.\n<|endoftext|>',  # on the last, without a newline after it
    'First.\n<|endoftext|>\n<|endoftext|>\nSecond.\n',  # two in a row
])
def test_every_separator_line_splits_documents(tmp_path, text):
    encoder = get_encoder()
    (tmp_path / 'a.txt').write_text(text)
    chunks = load_dataset(str(tmp_path / 'a.txt'), encoder, combine=10**9)
    assert [c.tolist() for c in chunks] == [encoder.encode('First.') + [50256] + encoder.encode('Second.') + [50256]]


def test_an_npz_of_tokens_loads_unchanged_and_encode_writes_one(tmp_path):
    arrays = [np.arange(300, dtype=np.int32), np.arange(50, 120, dtype=np.int32)]
    np.savez_compressed(tmp_path / 'gpt2-simple.npz', *arrays)  # gpt-2-simple's encode_dataset format
    loaded = load_dataset(str(tmp_path / 'gpt2-simple.npz'), get_encoder())
    assert [c.tolist() for c in loaded] == [a.tolist() for a in arrays]
    (tmp_path / 'text.txt').write_text('Hello there. ' * 50)
    count = encode_dataset(str(tmp_path / 'text.txt'), str(tmp_path / 'out.npz'), get_encoder())
    again = load_dataset(str(tmp_path / 'out.npz'), get_encoder())
    assert sum(c.size for c in again) == count == len(get_encoder().encode('Hello there. ' * 50)) + 1


def test_npz_files_in_a_folder_or_glob_load_as_tokens(tmp_path):
    arrays = [np.arange(300, dtype=np.int32), np.arange(50, 120, dtype=np.int32)]
    (tmp_path / 'data').mkdir()
    np.savez_compressed(tmp_path / 'data' / 'part1.npz', arrays[0])
    np.savez_compressed(tmp_path / 'data' / 'part2.npz', arrays[1])
    for path in (tmp_path / 'data', tmp_path / 'data' / '*.npz'):
        assert [c.tolist() for c in load_dataset(str(path), get_encoder())] == [a.tolist() for a in arrays]
    (tmp_path / 'data' / 'part3.npz').write_bytes(b'PK not a zip')
    with pytest.raises(GPT2Error, match=r'part3.npz: not an .npz of token arrays'):
        load_dataset(str(tmp_path / 'data'), get_encoder())


@pytest.mark.parametrize('setup, message', [
    (lambda p: None, 'no dataset at'),
    (lambda p: (p / 'data.txt').write_text('\n\r\n\n'), 'is empty: no tokens'),
    (lambda p: np.savez(p / 'data.npz', np.array([5, 60000])), 'dataset token id 60000 is outside the vocabulary'),
])
def test_bad_datasets(tmp_path, setup, message):
    setup(tmp_path)
    target = next(iter(sorted(tmp_path.iterdir())), tmp_path / 'missing.txt')
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_dataset(str(target), get_encoder())


def test_windows_are_reproducible_and_stay_inside_a_chunk():
    chunks = [np.arange(0, 100), np.arange(1000, 1010), np.arange(2000, 2040)]
    a, b = Sampler(chunks, 32, seed=5), Sampler(chunks, 32, seed=5)
    for _ in range(50):
        batch = a.sample(3)
        np.testing.assert_array_equal(batch, b.sample(3))
        assert batch.shape == (3, 32) and (np.diff(batch, axis=1) == 1).all()  # contiguous: one chunk each
    with pytest.raises(ValueError, match='shorter than one training window: its longest chunk has 10 tokens'):
        Sampler([np.arange(10)], 32)
    with pytest.raises(GPT2Error, match='shorter than one training window: its longest chunk has 0 tokens'):
        Sampler([], 32)  # no chunk at all (max() of nothing was a ValueError of its own)
    with pytest.warns(UserWarning, match=r'^2 of 3 chunks of the dataset \(30 tokens\) are shorter than a training '
                                         r'window \(n_ctx = 32\) and are never trained on: gather documents into '
                                         r'longer chunks \(a larger combine\)'):
        dropped = Sampler([np.arange(10), np.arange(40), np.arange(20)], 32)
    assert dropped.ranges == [(10, 50)]  # the 40-token chunk's place among the three laid end to end


# --- run folders ------------------------------------------------------------------------------------

def test_save_restore_resumes_exactly(tmp_path):
    data = batches(8)
    whole = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    straight = [whole.step(b) for b in data]
    first = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    losses = [first.step(b) for b in data[:4]]
    first.save(str(tmp_path / 'run'))
    assert sorted(os.listdir(tmp_path / 'run')) == [
        'checkpoint', 'counter', 'encoder.json', 'hparams.json', 'model-4.data-00000-of-00001', 'model-4.index',
        'optimizer-4.data-00000-of-00001', 'optimizer-4.index', 'vocab.bpe']
    second = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    second.restore(str(tmp_path / 'run'))
    assert second.steps == 4
    losses += [second.step(b) for b in data[4:]]
    np.testing.assert_allclose(losses, straight, rtol=1e-6)
    # The model checkpoint alone loads strictly, and in the original graph with a Saver.
    model = gpt2_tf.load_model(tmp_path / 'run')
    ref = Reference(HPARAMS, str(tmp_path / 'run' / 'model-4'))
    tokens = data[0][:1]
    assert np.abs(model(tokens)['logits'].numpy() - ref(tokens)['logits']).max() <= tolerance(ref(tokens)['logits'])


def test_a_resumed_run_draws_the_windows_an_uninterrupted_one_draws(tmp_path):
    chunks = [np.random.default_rng(1).integers(0, HPARAMS.n_vocab, 900).astype(np.int32)]
    options = dict(checkpoint_dir=str(tmp_path), sample_every=0, print_every=1, seed=7, batch_size=2,
                   accumulate_gradients=1)

    def losses(run_name, steps, **more):
        lines = []
        finetune(str(HOT), chunks, steps=steps, run_name=run_name, log=lines.append, **options, **more)
        return [float(m.group(1)) for m in map(re.compile(r'loss=([\d.]+)').search, lines) if m]

    straight = losses('straight', 4)
    resumed = losses('parts', 2) + losses('parts', 2, restore_from='latest')
    assert len(straight) == 4 and resumed == straight


def test_a_gpt2_simple_run_folder_loads_and_training_continues(tmp_path):
    run = tmp_path / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    for f in ('model.ckpt.data-00000-of-00001', 'model.ckpt.index'):
        shutil.copy(HOT / f, run / f.replace('model.ckpt', 'model-42'))
    shutil.copy(HOT / 'hparams.json', run)
    (run / 'checkpoint').write_text('model_checkpoint_path: "/content/checkpoint/run1/model-42"\n'
                                    'all_model_checkpoint_paths: "/content/checkpoint/run1/model-42"\n')
    (run / 'counter').write_text('42')
    assert gpt2_tf.load_model(run).hparams == HPARAMS  # loads unchanged
    chunks = [np.random.default_rng(0).integers(0, HPARAMS.n_vocab, 500).astype(np.int32)]
    lines = []
    trainer = finetune(str(HOT), chunks, steps=2, checkpoint_dir=str(tmp_path / 'checkpoint'), batch_size=2,
                       accumulate_gradients=1, sample_every=0, seed=1, log=lines.append)
    assert trainer.steps == 44 and any('step 42' in line for line in lines)
    assert (run / 'counter').read_text().strip() == '44' and (run / 'model-44.index').exists()


def test_a_finetune_lowers_the_loss_survives_an_interruption_and_loads_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / 'corpus.txt'
    text.write_text('The cat sat on the mat. The dog sat on the log. ' * 60)
    lines = []

    def interrupt_at_10(step):
        if step == 10:
            raise KeyboardInterrupt  # what Ctrl-C raises
        return False

    common = dict(checkpoint_dir='checkpoint', batch_size=2, accumulate_gradients=1, learning_rate=3e-3,
                  sample_every=0, save_every=0, seed=3, log=lines.append)
    with pytest.raises(KeyboardInterrupt) as interrupted:  # saved, then raised again: a script can tell
        finetune(bundled_checkpoint(), str(text), steps=20, stop=interrupt_at_10, **common)
    first = interrupted.value.trainer
    assert first.steps == 10 and 'interrupted' in lines and (tmp_path / 'checkpoint/run1/model-10.index').exists()
    second = finetune(bundled_checkpoint(), str(text), steps=10, **common)
    assert second.steps == 20
    losses = [float(line.split('loss=')[1].split()[0]) for line in lines if 'loss=' in line]
    assert len(losses) == 20 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    run = tmp_path / 'checkpoint' / 'run1'
    gpt2_tf.load_model(run)
    Reference(gpt2_tf.load_model(run).hparams, str(run / 'model-20'))  # the TF1 Saver restores it
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'generate', 'The cat', '--model_dir', str(run),
                           '--length', '5', '--seed', '1'], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and 'SAMPLE 1' in done.stdout, done.stderr


def test_a_full_disk_at_save_time_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    trainer.step(batches(1)[0])
    trainer.save(str(tmp_path))
    trainer.step(batches(1)[0])

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(gpt2_tf.checkpoint, 'write_tensors', full)
    with pytest.raises(OSError):
        trainer.save(str(tmp_path))
    monkeypatch.undo()
    assert gpt2_tf.checkpoint.find_checkpoint(tmp_path).endswith('model-1')
    gpt2_tf.load_model(tmp_path)


def test_a_run_of_another_model_size_is_refused(tmp_path):
    Trainer(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), 1e-3).save(str(tmp_path / 'run1'))
    with pytest.raises(ValueError, match='holds a run of another model size'):
        finetune(str(HOT), [np.arange(200, dtype=np.int32)], steps=1, checkpoint_dir=str(tmp_path), log=print)


def test_finetune_command(tmp_path):
    (tmp_path / 'corpus.txt').write_text('One two three four five six seven. ' * 40)
    cmd = [sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--steps', '3', '--batch_size', '1',
           '--accumulate_gradients', '2', '--sample_every', '3', '--sample_length', '8', '--seed', '1']
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '[3 |' in done.stdout and 'loss=' in done.stdout and '======== SAMPLE 1 ========' in done.stdout
    assert (tmp_path / 'checkpoint' / 'run1' / 'model-3.index').exists()
    assert (tmp_path / 'samples' / 'run1' / 'samples-3').exists()
    bad = subprocess.run([*cmd[:4], 'missing.txt', '--run_name', 'run2', '--sample_every', '3'], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and 'no dataset at missing.txt' in bad.stderr.splitlines()[-1]
    assert sorted(os.listdir(tmp_path / 'checkpoint')) == sorted(os.listdir(tmp_path / 'samples')) == ['run1']


def chunks_of(n=500):
    return [np.random.default_rng(0).integers(0, HPARAMS.n_vocab, n).astype(np.int32)]


def test_the_log_averages_as_gpt2_simple_and_each_step_is_saved_once(tmp_path):
    lines = []
    finetune(str(HOT), chunks_of(), steps=6, checkpoint_dir=str(tmp_path), batch_size=2, accumulate_gradients=1,
             sample_every=0, save_every=3, print_every=2, seed=1, log=lines.append)
    printed = [re.search(r'\[(\d+) \| [\d.]+\] loss=([\d.]+) avg=([\d.]+)', line) for line in lines]
    printed = [(int(m[1]), float(m[2]), float(m[3])) for m in printed if m]
    assert [step for step, _, _ in printed] == [2, 4, 6]
    total = weight = 0.0
    for _, loss, avg in printed:  # gpt-2-simple: (sum, weight) decayed by 0.99 at each printed step
        total, weight = total * 0.99 + loss, weight * 0.99 + 1.0
        assert avg == pytest.approx(total / weight, abs=2e-4)
    assert [line for line in lines if line.startswith('Saving')] == [f'Saving {tmp_path / "run1" / "model-3"}',
                                                                    f'Saving {tmp_path / "run1" / "model-6"}']


def test_what_a_run_cannot_write_is_refused_before_its_first_step(tmp_path):
    never = lambda step: pytest.fail('trained before refusing')  # noqa: E731
    options = dict(steps=1, batch_size=2, accumulate_gradients=1, sample_every=0, seed=1, log=lambda line: None)
    finetune(str(HOT), chunks_of(), checkpoint_dir=str(tmp_path), run_name='r', **options)
    with pytest.raises(gpt2_tf.CheckpointError, match='holds a run of another model size'):
        finetune(str(FIXTURES / 'tf1-tiny'), chunks_of(), checkpoint_dir=str(tmp_path), run_name='r',
                 restore_from='fresh', stop=never, **options)
    (tmp_path / 'file').write_text('not a folder')
    with pytest.raises(GPT2Error, match=r'cannot create .*file.r \(Not a directory\): give --checkpoint_dir a '
                                        r'folder that can be written'):
        finetune(str(HOT), chunks_of(), checkpoint_dir=str(tmp_path / 'file'), run_name='r', stop=never, **options)
    with pytest.raises(GPT2Error, match='give --sample_dir a folder that can be written'):
        finetune(str(HOT), chunks_of(), checkpoint_dir=str(tmp_path), run_name='s', stop=never,
                 **{**options, 'sample_every': 1, 'sample_dir': str(tmp_path / 'file')})


def test_ctrl_c_saves_the_step_reached_and_raises_again(tmp_path):
    def ctrl_c_at_3(step):
        if step == 3:
            raise KeyboardInterrupt  # what Ctrl-C raises between two steps
        return False

    chunks = [np.random.default_rng(0).integers(0, HPARAMS.n_vocab, 500).astype(np.int32)]
    lines = []
    with pytest.raises(KeyboardInterrupt) as interrupted:
        finetune(str(HOT), chunks, steps=10, checkpoint_dir=str(tmp_path), batch_size=2, accumulate_gradients=1,
                 sample_every=0, save_every=0, seed=1, log=lines.append, stop=ctrl_c_at_3)
    assert isinstance(interrupted.value, train.Interrupted) and interrupted.value.trainer.steps == 3
    run = tmp_path / 'run1'
    assert lines[-2:] == ['interrupted', f'Saving {run / "model-3"}']
    assert (run / 'counter').read_text().strip() == '3'
    assert (run / 'model-3.index').exists() and (run / 'optimizer-3.index').exists()
    resumed = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    resumed.restore(str(run))
    assert resumed.steps == 3
    for name, variable in interrupted.value.trainer.model.variables_by_name().items():
        np.testing.assert_array_equal(resumed.model.variables_by_name()[name].numpy(), variable.numpy(), name)
    for name, slot in interrupted.value.trainer.slots.items():
        np.testing.assert_array_equal(resumed.slots[name].numpy(), slot.numpy(), name)


def test_a_ctrl_c_inside_a_step_takes_effect_after_its_update_and_its_count():
    trainer = Trainer(gpt2_tf.load_model(HOT), 1e-2, 'sgd')
    compiled_step = trainer._step

    def update_then_ctrl_c(tokens, learning_rate):
        loss = compiled_step(tokens, learning_rate)
        os.kill(os.getpid(), signal.SIGINT)  # after the variables moved, before the step is counted
        return loss

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's process
    try:
        trainer._step = update_then_ctrl_c
        before = trainer.model.h[0].mlp.c_fc.w.numpy().copy()
        with pytest.raises(KeyboardInterrupt):
            trainer.step(batches(1)[0])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert trainer.steps == 1  # the update happened, so it is counted: a save now holds step 1's weights
    assert np.abs(trainer.model.h[0].mlp.c_fc.w.numpy() - before).max() > 0


@pytest.mark.parametrize('stop', [signal.SIGINT, signal.SIGTERM], ids=['ctrl-c', 'sigterm'])
def test_ctrl_c_in_the_finetune_command_exits_130_after_saving(tmp_path, stop):
    (tmp_path / 'corpus.txt').write_text('One two three four five six seven. ' * 40)
    command = [sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--batch_size', '1',
               '--accumulate_gradients', '1', '--sample_every', '0', '--save_every', '0', '--seed', '1']
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint)
    try:
        seen = ''
        while '[2 |' not in seen:  # steps=-1: it trains until interrupted
            line = process.stdout.readline()
            assert line, process.stderr.read()[-2000:]
            seen += line
        process.send_signal(stop)  # as Ctrl-C, or a job scheduler's stop
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err[-2000:]
    assert 'interrupted' in out and 'Saving' in out
    saved = int((tmp_path / 'checkpoint' / 'run1' / 'counter').read_text())
    assert saved >= 2 and (tmp_path / 'checkpoint' / 'run1' / f'model-{saved}.index').exists()


def damage(prefix, how):
    """Rewrites or breaks the optimizer state at prefix; returns the tensor the refusal must name."""
    data = pathlib.Path(prefix + '.data-00000-of-00001')
    if how == 'truncated':
        data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
        return 'truncated'
    if how == 'corrupt':
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF  # the first tensor in the file: TF writes them sorted by name
        data.write_bytes(bytes(raw))
        return 'beta1_power'
    reader = tf.train.load_checkpoint(prefix)
    tensors = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    name = {'missing': 'model/wte/Adam', 'shape': 'model/h0/attn/c_attn/b/Adam',
            'dtype': 'model/h1/mlp/c_fc/w/Adam_1'}[how]
    if how == 'missing':
        del tensors[name]
    elif how == 'shape':
        tensors[name] = tensors[name][:3]
    else:
        tensors[name] = tensors[name].astype(np.float16)
    gpt2_tf.checkpoint.remove_bundle(prefix)
    gpt2_tf.checkpoint.write_tensors(prefix, tensors)
    return name


@pytest.mark.parametrize('how', ['missing', 'shape', 'dtype', 'truncated', 'corrupt'])
def test_a_damaged_or_mismatched_optimizer_state_is_refused_and_changes_nothing(tmp_path, how):
    trainer = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    trainer.step(batches(1)[0])
    trainer.save(str(tmp_path))
    named = damage(str(tmp_path / 'optimizer-1'), how)
    fresh = Trainer(gpt2_tf.load_model(HOT), 1e-3)
    before = {n: v.numpy() for n, v in {**fresh.model.variables_by_name(), **fresh.slots}.items()}
    with pytest.raises(gpt2_tf.CheckpointError, match='optimizer state .*optimizer-1') as refused:
        fresh.restore(str(tmp_path))
    message = str(refused.value)
    assert named in message and '\n' not in message, message
    assert fresh.steps == 0
    for name, variable in {**fresh.model.variables_by_name(), **fresh.slots}.items():
        np.testing.assert_array_equal(variable.numpy(), before[name], name)  # read first, then assigned


# --- token files, read in place -----------------------------------------------------------------------

# Training documents are words, validation documents digits: their ids never overlap, so a window tells
# which part of the file it came from without asking the code under test.
WORDS = 'The cat sat on the mat and the dog sat on the log. '
DIGITS = '1234 5678 9012 3456 7890 '


def token_file(tmp_path, train_docs=6, val_docs=3):
    folder = tmp_path / 'texts'
    folder.mkdir()
    for i in range(train_docs):
        (folder / f'a{i}.txt').write_text((WORDS * (20 + i)).strip())
    for i in range(val_docs):
        (folder / f'b{i}.txt').write_text((DIGITS * (30 + i)).strip())
    corpus.encode_corpus([folder], tmp_path / 'train.bin')
    encoder = get_encoder()
    words, digits = set(encoder.encode((WORDS * 2).strip())), set(encoder.encode((DIGITS * 2).strip()))
    assert not words & digits
    return tmp_path / 'train.bin', words, digits


def finetune_lines(model_dir, dataset, tmp_path, **options):
    lines = []
    common = dict(steps=3, checkpoint_dir=str(tmp_path / 'checkpoint'), sample_dir=str(tmp_path / 'samples'),
                  restore_from='fresh', batch_size=2, accumulate_gradients=1, learning_rate=1e-3, sample_every=0,
                  save_every=0, log=lines.append)
    trainer = finetune(str(model_dir), str(dataset), **{**common, **options})
    return trainer, lines


def test_finetune_on_a_token_file_is_seeded_and_holds_out_whole_documents(tmp_path):
    path, words, digits = token_file(tmp_path)
    run = train.Run(bundled_checkpoint(), str(path), train.configure(seed=4, val_fraction=0.3, val_every=1,
                                                                       val_batch_count=4, sample_every=0,
                                                                       checkpoint_dir=str(tmp_path / 'checkpoint')))
    end = {50256}
    for _ in range(20):  # training windows only from the word documents, validation ones only from the digits
        assert set(run.sampler.sample(4).ravel().tolist()) <= words | end
    for batch in run.validation:
        assert set(batch.ravel().tolist()) <= digits | end
    # the same seed, the same windows and losses; another seed, others
    _, first = finetune_lines(bundled_checkpoint(), path, tmp_path, seed=4, val_fraction=0.3, val_every=2)
    _, again = finetune_lines(bundled_checkpoint(), path, tmp_path, seed=4, val_fraction=0.3, val_every=2)
    _, other = finetune_lines(bundled_checkpoint(), path, tmp_path, seed=5, val_fraction=0.3, val_every=2)
    losses = lambda lines: [line.split('] ')[1] for line in lines if 'loss' in line]  # noqa: E731
    assert len(losses(first)) == 5 and any('validation loss' in line for line in first)
    assert losses(first) == losses(again) and losses(first) != losses(other)


def test_samples_draw_as_gpt2_simples_after_a_token_of_the_data_and_leave_the_windows_as_they_were(tmp_path):
    text = tmp_path / 'corpus.txt'
    text.write_text('alpha beta gamma delta epsilon zeta eta theta. ' * 30)
    options = dict(steps=6, sample_num=3, sample_length=6, seed=5, sample_dir=str(tmp_path / 'samples'))
    _, plain = finetune_lines(bundled_checkpoint(), text, tmp_path, **options)
    trainer, lines = finetune_lines(bundled_checkpoint(), text, tmp_path, sample_every=3, **options)
    losses = lambda lines: [line.split('] ')[1] for line in lines if 'loss=' in line]  # noqa: E731
    assert len(losses(plain)) == 6 and losses(lines) == losses(plain)  # the start token is drawn apart
    written = (tmp_path / 'samples' / 'run1' / 'samples-6').read_text(encoding='utf-8')
    encoder = gpt2_tf.encoder.encoder_for(bundled_checkpoint())
    data = set(encoder.encode(text.read_text()))
    starts = {encoder.encode(part.split('\n', 1)[1])[0] for part in written.split('======== SAMPLE ')[1:]}
    assert len(starts) == 1 and starts <= data  # one token of the data starts every sample
    out = gpt2_tf.sample_sequence(trainer.model, 6, context=[[*starts]] * 3, top_k=40, seed=(5, 6))
    texts = [f'======== SAMPLE {i} ========\n{encoder.decode(row)}\n' for i, row in enumerate(out, start=1)]
    assert written == '\n'.join(texts) and [line for line in lines if 'SAMPLE' in line][3:] == texts  # printed


def test_a_token_file_trains_a_model_folder_without_vocabulary_files(tmp_path):
    folder = tmp_path / 'model'
    shutil.copytree(bundled_checkpoint(), folder)
    (folder / 'tokenizer.json').write_text('{}')  # no encoder.json, vocab.bpe, vocab.json or merges.txt
    with pytest.raises(GPT2Error, match='only a tokenizer.json'):
        gpt2_tf.encoder.encoder_for(folder)
    path, _, _ = token_file(tmp_path)
    trainer, lines = finetune_lines(folder, path, tmp_path, seed=1)
    assert trainer.steps == 3 and (tmp_path / 'checkpoint' / 'run1' / 'model-3.index').exists()
    with pytest.raises(GPT2Error, match='only a tokenizer.json'):  # samples need text: the vocabulary
        finetune_lines(folder, path, tmp_path, seed=1, sample_every=2)
    (tmp_path / 'val.txt').write_text('Held out text. ' * 40)
    with pytest.raises(GPT2Error, match='only a tokenizer.json'):  # and so does a validation set of text
        finetune_lines(folder, path, tmp_path, seed=1, val_dataset=str(tmp_path / 'val.txt'), val_every=1)


def test_a_token_file_of_another_vocabulary_is_refused_in_one_line(tmp_path):
    path, _, _ = token_file(tmp_path)
    with pytest.raises(GPT2Error, match=r'vocabulary of 50,257 ids, and the model has 300') as refused:
        finetune_lines(HOT, path, tmp_path)  # a tiny model of 300 ids
    assert '\n' not in str(refused.value)
    folder = tmp_path / 'model'
    shutil.copytree(bundled_checkpoint(), folder)
    table = json.loads((pathlib.Path(gpt2_tf.encoder.__file__).parent / 'assets' / 'encoder.json').read_text())
    table['a'], table['b'] = table['b'], table['a']  # the same size, another vocabulary
    (folder / 'encoder.json').write_text(json.dumps(table))
    shutil.copy(pathlib.Path(gpt2_tf.encoder.__file__).parent / 'assets' / 'vocab.bpe', folder)
    with pytest.raises(GPT2Error, match=r"encoded with another vocabulary than .*model's \(sha256"):
        finetune_lines(folder, path, tmp_path)
    # nanoGPT's train.bin has no sidecar: its ids are checked as windows are drawn
    np.arange(1000, dtype='<u2').tofile(tmp_path / 'nano.bin')
    with pytest.raises(GPT2Error, match=r"nano.bin holds token id \d+ .*outside the model's vocabulary \[0, 300\)"):
        finetune_lines(HOT, tmp_path / 'nano.bin', tmp_path)
    (np.arange(1000) % 300).astype('<u2').tofile(tmp_path / 'nano.bin')
    assert finetune_lines(HOT, tmp_path / 'nano.bin', tmp_path, steps=1)[0].steps == 1


def test_val_dataset_takes_a_token_file_and_val_fraction_needs_one(tmp_path):
    path, words, digits = token_file(tmp_path)
    (tmp_path / 'held').mkdir()
    (tmp_path / 'held' / 'h.txt').write_text((DIGITS * 40).strip())
    corpus.encode_corpus([tmp_path / 'held'], tmp_path / 'held.bin')
    run = train.Run(bundled_checkpoint(), str(path), train.configure(
        seed=1, val_dataset=str(tmp_path / 'held.bin'), val_every=1, val_batch_count=3, sample_every=0,
        checkpoint_dir=str(tmp_path / 'checkpoint')))
    assert len(run.validation) == 3 and all(set(b.ravel().tolist()) <= digits | {50256} for b in run.validation)
    assert set(run.sampler.sample(8).ravel().tolist()) & words  # the whole file trains: no split asked
    (tmp_path / 'corpus.txt').write_text(WORDS * 40)
    with pytest.raises(GPT2Error, match='val_fraction holds out documents of a token file'):
        finetune_lines(bundled_checkpoint(), tmp_path / 'corpus.txt', tmp_path, val_fraction=0.2, val_every=1)


# --- the run folder: what a crash, a copy or another tool's save leaves ------------------------------

def run_steps(tmp_path, steps, **options):
    chunks = [np.random.default_rng(0).integers(0, HPARAMS.n_vocab, 500).astype(np.int32)]
    common = dict(checkpoint_dir=str(tmp_path / 'checkpoint'), sample_dir=str(tmp_path / 'samples'), batch_size=2,
                  accumulate_gradients=1, sample_every=0, seed=1, log=lambda line: None)
    return finetune(str(HOT), chunks, steps=steps, **{**common, **options})


def test_a_counter_left_behind_by_a_cut_save_resumes_at_the_step_saved(tmp_path):
    run_steps(tmp_path, 4)
    run = tmp_path / 'checkpoint' / 'run1'
    (run / 'counter').write_text('2\n')  # the step before: killed between the save's switch and the counter
    assert run_steps(tmp_path, 1).steps == 5 and (run / 'model-5.index').exists()


def test_a_run_folder_holding_an_hf_model_is_refused_before_a_step_and_a_stray_config_json_is_not(tmp_path):
    run = tmp_path / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    (run / 'config.json').write_text('{"lr": 0.0001}')  # someone's notes, not a model
    assert run_steps(tmp_path, 1).steps == 1 and (run / 'model-1.index').exists()
    other = tmp_path / 'checkpoint' / 'run2'
    other.mkdir()
    (other / 'config.json').write_text('{"model_type": "gpt2"}')
    (other / 'model.safetensors').write_bytes(b'weights')
    taken = []
    with pytest.raises(gpt2_tf.CheckpointError, match=r'run2 holds a Hugging Face model \(config.json and its '
                                                      r'weights\)'):
        run_steps(tmp_path, 1, run_name='run2', log=taken.append)
    assert not [line for line in taken if 'loss=' in line]  # refused before its first step
    assert sorted(os.listdir(other)) == ['config.json', 'model.safetensors']


def test_a_fresh_run_over_a_folder_never_pairs_one_runs_model_with_anothers_optimizer(tmp_path, monkeypatch):
    run = tmp_path / 'checkpoint' / 'run1'
    run_steps(tmp_path, 2)
    earlier = {f.name: f.read_bytes() for f in run.iterdir() if f.name.startswith(('model-2', 'optimizer-2'))}
    killed, live = f'.saving-{ended_pid()}-killed_1', f'.saving-{os.getpid()}-running'
    for staging in killed, live:  # a killed save's staging, and one of a save still running in this process
        (run / staging).mkdir()
        (run / staging / 'bundle.data-00000-of-00001').write_bytes(b'x' * 100)
    writes = []

    def full_at_the_last(prefix, tensors, write=gpt2_tf.checkpoint.write_tensors):
        writes.append(os.path.basename(prefix))
        if len(writes) == 2:  # the new run's model was written, its optimizer state fails
            raise OSError(errno.ENOSPC, 'No space left on device')
        write(prefix, tensors)

    monkeypatch.setattr(gpt2_tf.checkpoint, 'write_tensors', full_at_the_last)
    with pytest.raises(OSError, match=r'cannot save step 2 .* the previous checkpoint \(model-2\) is intact'):
        run_steps(tmp_path, 2, restore_from='fresh', seed=7, learning_rate=0.05)
    monkeypatch.undo()
    assert writes == ['model', 'optimizer'] and not (run / killed).exists() and (run / live).exists()
    # Both new bundles are written before the earlier run's are touched: that run's pair is as it was.
    assert gpt2_tf.checkpoint.checkpoint_state(str(run)) == ('model-2', ['model-2'])
    assert {name: (run / name).read_bytes() for name in earlier} == earlier
    assert run_steps(tmp_path, 2, restore_from='fresh', optimizer='sgd').steps == 2  # SGD saves no slots,
    assert not (run / 'optimizer-2.index').exists()  # and the earlier run's optimizer-2 goes with its model


def test_a_refused_save_leaves_the_folder_as_it_was(tmp_path):
    trainer = Trainer(gpt2_tf.load_model(FIXTURES / 'tf1-tiny'), 1e-3)
    trainer.save(str(tmp_path))  # model-0 of another model size
    files = sorted(f.name for f in tmp_path.iterdir())
    with pytest.raises(gpt2_tf.CheckpointError, match='holds a model of another size'):
        Trainer(gpt2_tf.load_model(HOT), 1e-3).save(str(tmp_path))
    assert sorted(f.name for f in tmp_path.iterdir()) == files


def test_a_failure_before_the_first_step_saves_nothing(tmp_path, monkeypatch):
    run_steps(tmp_path, 4)
    run = tmp_path / 'checkpoint' / 'run1'

    def fails(model, batches):
        raise MemoryError('validation ran out of memory')

    monkeypatch.setattr(train, 'validation_loss', fails)
    np.savez(tmp_path / 'held.npz', np.random.default_rng(1).integers(0, HPARAMS.n_vocab, 500).astype(np.int32))
    with pytest.raises(MemoryError):  # at step 0, before the fresh run's first step
        run_steps(tmp_path, 2, restore_from='fresh', val_dataset=str(tmp_path / 'held.npz'), val_every=2)
    assert gpt2_tf.checkpoint.checkpoint_state(str(run)) == ('model-4', ['model-4'])  # the earlier run's


def test_a_log_whose_reader_has_gone_saves_the_step_reached(tmp_path):
    """finetune | head -2: the third line cannot be written; the steps are kept, as at Ctrl-C, and said so."""
    lines = []

    def head_2(line):
        if len(lines) == 2:
            raise BrokenPipeError(32, 'Broken pipe')
        lines.append(line)

    chunks = [np.random.default_rng(0).integers(0, HPARAMS.n_vocab, 500).astype(np.int32)]
    with pytest.raises(train.Interrupted, match="^the log's output closed at step 3, which is saved$"):
        finetune(str(HOT), chunks, steps=10, checkpoint_dir=str(tmp_path), batch_size=2, accumulate_gradients=1,
                 sample_every=0, save_every=0, print_every=1, seed=1, log=head_2)
    assert (tmp_path / 'run1' / 'model-3.index').exists() and len(lines) == 2
    assert (tmp_path / 'run1' / 'counter').read_text().strip() == '3'


def test_ctrl_c_before_the_first_step_saves_nothing(tmp_path, monkeypatch):
    run_steps(tmp_path, 4)
    run = tmp_path / 'checkpoint' / 'run1'
    before = {f.name: f.read_bytes() for f in run.iterdir()}

    def interrupted(model, batches):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, 'validation_loss', interrupted)
    np.savez(tmp_path / 'held.npz', np.random.default_rng(1).integers(0, HPARAMS.n_vocab, 500).astype(np.int32))
    with pytest.raises(train.Interrupted, match="interrupted at step 0, before this run's first step: the run "
                                                "folder is as it was"):
        run_steps(tmp_path, 2, restore_from='fresh', val_dataset=str(tmp_path / 'held.npz'), val_every=2)
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before  # the earlier run's model-4, not a model-0


def test_a_run_folder_saved_with_tf1_adams_slots_resumes_with_them(tmp_path):
    model = gpt2_tf.load_model(HOT)
    rng = np.random.default_rng(3)
    weights = {name: v.numpy() for name, v in model.variables_by_name().items()}
    slots = {'beta1_power': np.float32(0.9 ** 5), 'beta2_power': np.float32(0.999 ** 5)}
    for name, value in weights.items():
        slots[f'{name}/Adam'] = rng.normal(0, 1e-3, value.shape).astype(np.float32)
        slots[f'{name}/Adam_1'] = rng.uniform(0, 1e-5, value.shape).astype(np.float32)
    run = tmp_path / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    gpt2_tf.checkpoint.write_tensors(str(run / 'model-5'), {**weights, **slots})  # a Saver over every variable
    (run / 'checkpoint').write_text('model_checkpoint_path: "model-5"\nall_model_checkpoint_paths: "model-5"\n')
    shutil.copy(HOT / 'hparams.json', run)
    lines = []
    trainer = run_steps(tmp_path, 0, log=lines.append)
    assert trainer.steps == 5 and any('step 5' in line for line in lines)
    for name, value in slots.items():
        np.testing.assert_array_equal(trainer.slots[name].numpy(), value, name)


def test_a_copied_run_folder_loads_its_own_files_not_those_its_checkpoint_file_names(tmp_path):
    run_steps(tmp_path, 2)
    original, copy = tmp_path / 'checkpoint' / 'run1', tmp_path / 'copy'
    shutil.copytree(original, copy)
    (copy / 'checkpoint').write_text(f'model_checkpoint_path: "{original / "model-2"}"\n')  # TF1's absolute paths
    run_steps(tmp_path, 2, restore_from='fresh', seed=9)  # the original folder goes on: another model-2 there
    assert gpt2_tf.checkpoint.find_checkpoint(copy) == str(copy / 'model-2')


def test_a_damaged_vocabulary_in_the_run_folder_is_replaced_whole_and_an_hf_bases_is_kept(tmp_path):
    base = tmp_path / 'hf'
    shutil.copytree(bundled_checkpoint(), base)
    encoder, bpe = gpt2_tf.assets.bundled_vocabulary()
    vocab = json.loads(pathlib.Path(encoder).read_text(encoding='utf-8'))
    vocab = {symbol: (token + 1) % len(vocab) for symbol, token in vocab.items()}  # a vocabulary of its own
    (base / 'vocab.json').write_text(json.dumps(vocab), encoding='utf-8')
    shutil.copy(bpe, base / 'merges.txt')
    run = tmp_path / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    (run / 'encoder.json').write_text(json.dumps(vocab)[:1000])  # what a save cut short left
    text = tmp_path / 'corpus.txt'
    text.write_text('one two three four five six seven eight nine ten. ' * 30)
    finetune_lines(base, text, tmp_path, steps=1, restore_from='latest')
    assert (run / 'encoder.json').read_bytes() == (base / 'vocab.json').read_bytes()
    assert (run / 'vocab.bpe').read_bytes() == (base / 'merges.txt').read_bytes()


def test_a_failure_between_steps_saves_the_steps_done_first(tmp_path, monkeypatch):
    def fails(self):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(train.Run, 'samples', fails)
    with pytest.raises(OSError, match='No space left'):
        run_steps(tmp_path, 6, sample_every=3, save_every=1000)
    assert gpt2_tf.checkpoint.checkpoint_state(str(tmp_path / 'checkpoint' / 'run1'))[0] == 'model-3'


def test_a_learning_rate_set_between_steps_is_the_next_steps():
    first, second = batches(2)
    scheduled = Trainer(gpt2_tf.load_model(HOT), 1e-2, 'sgd')
    scheduled.step(first)
    scheduled.learning_rate = 5e-2
    scheduled.step(second)
    model = gpt2_tf.load_model(HOT)  # SGD has no state: two trainers over one model take the two rates
    Trainer(model, 1e-2, 'sgd').step(first)
    Trainer(model, 5e-2, 'sgd').step(second)
    for name, variable in model.variables_by_name().items():
        np.testing.assert_array_equal(scheduled.model.variables_by_name()[name].numpy(), variable.numpy(), name)
    with pytest.raises(GPT2Error, match='learning_rate must be a finite number > 0, got 0'):
        scheduled.learning_rate = 0


def test_a_save_whose_counter_cannot_be_written_says_the_step_is_saved(tmp_path, monkeypatch):
    def full(path, text, replace=gpt2_tf.checkpoint.replace_atomically):
        if os.path.basename(path) == 'counter':
            raise OSError(errno.ENOSPC, 'No space left on device')
        replace(path, text)

    monkeypatch.setattr(gpt2_tf.checkpoint, 'replace_atomically', full)
    with pytest.raises(OSError, match=r'step 2 is saved in .*, but writing its counter or vocabulary failed'):
        run_steps(tmp_path, 2)
    monkeypatch.undo()
    assert run_steps(tmp_path, 1).steps == 3  # resumed from model-2, whose name says its step


def test_the_bundled_vocabulary_never_replaces_one_a_run_folder_has(tmp_path):
    from gpt2_tf.runfolder import copy_vocabulary

    (tmp_path / 'encoder.json').write_text('{"a": 0}')  # placed by hand: the base model had none
    copy_vocabulary(str(tmp_path), None)
    assert (tmp_path / 'encoder.json').read_text() == '{"a": 0}' and (tmp_path / 'vocab.bpe').exists()
    (tmp_path / 'base.json').write_text('{"b": 0}')
    copy_vocabulary(str(tmp_path), {'encoder.json': str(tmp_path / 'base.json')})  # a base's own: replaced
    assert (tmp_path / 'encoder.json').read_text() == '{"b": 0}'


def test_an_optimizer_state_whose_model_is_gone_is_removed_at_the_next_save(tmp_path):
    run = tmp_path / 'checkpoint' / 'run1'
    run_steps(tmp_path, 2)
    for suffix in ('.index', '.data-00000-of-00001'):  # what a save interrupted while it removed model-1 left
        shutil.copy(run / f'optimizer-2{suffix}', run / f'optimizer-1{suffix}')
    shutil.copy(run / 'model-2.index', run / 'model-0.index')  # an unlisted model: kept, it may be the user's
    run_steps(tmp_path, 1)
    assert sorted(f.name for f in run.glob('optimizer-*.index')) == ['optimizer-3.index']
    assert (run / 'model-0.index').exists()


def test_one_save_of_a_run_folder_loads_by_its_prefix(tmp_path, capsys):
    from gpt2_tf.cli import main

    run = tmp_path / 'checkpoint' / 'run1'
    run_steps(tmp_path, 2, max_checkpoints=2)
    at_2 = {n: v.numpy() for n, v in gpt2_tf.load_model(run).variables_by_name().items()}
    run_steps(tmp_path, 2, max_checkpoints=2)  # model-4 is current now
    assert gpt2_tf.checkpoint.checkpoint_state(str(run)) == ('model-4', ['model-2', 'model-4'])
    for name, value in gpt2_tf.load_model(run / 'model-2').variables_by_name().items():
        np.testing.assert_array_equal(value.numpy(), at_2[name], name)  # gpt-2-simple's checkpoint='model-2'
    assert main(['inspect', str(run / 'model-2')]) == 0 and str(run / 'model-2') in capsys.readouterr().out
    assert main(['compare', str(run / 'model-2'), '--tokens', '1 2 3']) == 0  # the TF1 graph reads that save
    assert 'all states within tolerance' in capsys.readouterr().out
    lines = []
    trainer = finetune(str(run / 'model-2'), [np.arange(400, dtype=np.int32) % HPARAMS.n_vocab], steps=0,
                       checkpoint_dir=str(tmp_path / 'again'), log=lines.append, sample_every=0)
    for name, value in trainer.model.variables_by_name().items():  # a new run from that save
        np.testing.assert_array_equal(value.numpy(), at_2[name], name)
    with pytest.raises(GPT2Error, match='is a save of the run folder this run would resume .*--restore_from fresh'):
        finetune(str(run / 'model-2'), [np.arange(400, dtype=np.int32) % HPARAMS.n_vocab], steps=1,
                 checkpoint_dir=str(tmp_path / 'checkpoint'), log=lines.append, sample_every=0)
    with pytest.raises(gpt2_tf.loading.ModelNotFound, match='no model folder at'):
        gpt2_tf.load_model(run / 'model-3')


@pytest.mark.parametrize('optimizer', ['adam', 'sgd'])
def test_a_step_whose_loss_is_not_finite_changes_nothing_and_says_so(optimizer):
    trainer = Trainer(gpt2_tf.load_model(HOT), 1e-2, optimizer)
    trainer.step(batches(1)[0])
    before = {name: v.numpy().copy() for name, v in [*trainer.model.variables_by_name().items(),
                                                      *trainer.slots.items()]}
    gain = trainer.model.h[1].ln_1.g
    gain.assign(tf.tensor_scatter_nd_update(gain, [[3]], [np.nan]))  # one broken weight: every logit is NaN
    before['model/h1/ln_1/g'] = gain.numpy().copy()
    with pytest.raises(train.Diverged, match=r'^step 2: the loss is nan, so its update was not applied \(the model '
                                             r'stays at step 1\); lower the learning rate'):
        trainer.step(batches(2)[1])
    assert trainer.steps == 1
    for name, v in [*trainer.model.variables_by_name().items(), *trainer.slots.items()]:
        np.testing.assert_array_equal(v.numpy(), before[name], name)


def test_a_run_that_diverges_saves_the_last_finite_step_and_stops(tmp_path):
    # SGD at 10^6: the first updates are finite and throw the weights so far that a later step's are not
    with pytest.raises(train.Diverged, match=r'^step \d+: (the loss is|a gradient is not finite)') as refused:
        run_steps(tmp_path, 5, optimizer='sgd', learning_rate=1e6, save_every=1000)
    reached = int(re.match(r'step (\d+)', str(refused.value))[1]) - 1
    assert reached >= 1
    run = tmp_path / 'checkpoint' / 'run1'
    assert gpt2_tf.checkpoint.checkpoint_state(str(run))[0] == f'model-{reached}'
    saved = gpt2_tf.load_model(str(run))
    assert all(np.isfinite(v.numpy()).all() for v in saved.variables)
    assert np.isfinite(gpt2_tf.score(saved, batches(1, batch=1)[0])).all()
