"""Data-parallel fine-tuning: MirroredStrategy over 2 logical CPUs, and a real 2-worker gRPC cluster on 127.0.0.1.

Each case runs in subprocesses (logical devices and TF_CONFIG must be set before
TensorFlow starts), and every wait is bounded: collective timeouts in the
strategy, and a timeout on every subprocess.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gpt2_tf.assets import bundled_checkpoint

from conftest import FIXTURES

HOT = FIXTURES / 'tf1-tiny-hot'
STEPS, BATCH = 5, 4

MIRRORED = '''
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np
import gpt2_tf
from gpt2_tf.distribute import make_strategy
from gpt2_tf.train import Trainer
folder, optimizer, data = sys.argv[1:4]
batches, held_out = np.load(data)['batches'], np.load(data)['held_out']
results = {}
for name, strategy in (('two', make_strategy('mirrored')), ('one', None)):
    model = gpt2_tf.load_model(folder, strategy=strategy)
    trainer = Trainer(model, 1e-2 if optimizer == 'sgd' else 1e-3, optimizer, accumulate_gradients=2)
    results[name] = {'losses': [trainer.step(b) for b in batches],
                     'logits': model(held_out)['logits'].numpy().tolist(),
                     'replicas': strategy.num_replicas_in_sync if strategy else 1,
                     'weights': {n: v.numpy().tolist() for n, v in model.variables_by_name().items()
                                 if n in ('model/wte', 'model/h1/mlp/c_fc/w', 'model/ln_f/g')}}
print(json.dumps(results))
'''

LORA = '''
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np
import gpt2_tf
from gpt2_tf.distribute import make_strategy
from gpt2_tf.train import Trainer
folder, data = sys.argv[1:3]
batches, held_out = np.load(data)['batches'][:3], np.load(data)['held_out']
results = {}
for name, strategy in (('two', make_strategy('mirrored')), ('one', None)):
    model = gpt2_tf.load_model(folder, strategy=strategy)
    # micro-batch i of replica r draws part 2r + i's dropout masks: one device's micro-batch 2r + i of 4
    trainer = Trainer(model, 1e-1, 'sgd', 2 if strategy else 4, True, lora_rank=2, lora_targets='c_attn,mlp.c_fc',
                      lora_dropout=0.2)
    rng = np.random.default_rng(0)  # the same start on both sides
    for adapter in trainer.adapters.values():
        adapter.A.assign(rng.uniform(-0.1, 0.1, adapter.A.shape).astype(np.float32))
    base = model.h[0].mlp.c_fc.w.numpy()
    results[name] = {'losses': [trainer.step(b) for b in batches],
                     'logits': model(held_out)['logits'].numpy().tolist(),
                     'replicas': strategy.num_replicas_in_sync if strategy else 1,
                     'frozen': bool((model.h[0].mlp.c_fc.w.numpy() == base).all()),
                     'adapters': {n: [a.A.numpy().tolist(), a.B.numpy().tolist()] for n, a in trainer.adapters.items()}}
print(json.dumps(results))
'''

WORKER = '''
import json, sys
import numpy as np
import gpt2_tf
from gpt2_tf.distribute import make_strategy
from gpt2_tf.train import Trainer
folder, data = sys.argv[1:3]
strategy = make_strategy('multiworker', timeout=60)
model = gpt2_tf.load_model(folder, strategy=strategy)
trainer = Trainer(model, 1e-3, 'adam')
print(json.dumps({'losses': [trainer.step(b) for b in np.load(data)['batches']],
                  'replicas': strategy.num_replicas_in_sync}))
'''


def data(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / 'data.npz'
    np.savez(path, batches=rng.integers(0, 300, (STEPS, BATCH, 64)).astype(np.int32),
             held_out=rng.integers(0, 300, (2, 64)).astype(np.int32))
    return path


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(('127.0.0.1', 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


CHECKS = '''
import sys
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np
from gpt2_tf.train import Trainer, finetune
from gpt2_tf.validate import GPT2Error
folder, out = sys.argv[1:3]
chunks = [np.arange(400) % 300]
options = dict(steps=1, checkpoint_dir=out, sample_every=0, accumulate_gradients=1, strategy='mirrored',
               log=lambda line: None)
try:
    finetune(folder, chunks, batch_size=3, stop=lambda step: sys.exit('trained'), **options)
except GPT2Error as e:
    print('refused:', e)
def out_of_memory(self, tokens):
    raise tf.errors.ResourceExhaustedError(None, None, 'OOM when allocating tensor')
Trainer.step = out_of_memory
try:
    finetune(folder, chunks, batch_size=2, **options)
except Exception as e:
    print('raised:', type(e).__name__)
'''


def test_a_mirrored_run_refuses_a_batch_that_does_not_split_and_names_running_out_of_memory(tmp_path):
    done = subprocess.run([sys.executable, '-c', CHECKS, str(HOT), str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ('refused: batch_size 3 does not split over the 2 replicas of the strategy: give a multiple of 2 '
            '(--batch_size 2)') in done.stdout
    assert 'raised: ResourceExhaustedError' in done.stdout  # its own error, not a dead cluster's


@pytest.mark.parametrize('optimizer', ['adam', 'sgd'])
def test_mirrored_over_two_devices_equals_one_device(tmp_path, optimizer):
    done = subprocess.run([sys.executable, '-c', MIRRORED, str(HOT), optimizer, str(data(tmp_path))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    two, one = result['two'], result['one']
    assert two['replicas'] == 2
    np.testing.assert_allclose(two['losses'], one['losses'], rtol=1e-4)  # float32 sums in another order
    reference = np.array(one['logits'])
    assert np.abs(np.array(two['logits']) - reference).max() <= 1e-3 * max(1.0, np.abs(reference).max())
    if optimizer == 'sgd':  # without Adam's amplified rounding noise, the weights themselves agree
        for name, value in one['weights'].items():
            np.testing.assert_allclose(two['weights'][name], value, rtol=1e-5, atol=1e-5 * np.abs(value).max(),
                                       err_msg=name)


@pytest.mark.slow  # about 25 s: two strategies' worth of tracing
def test_lora_mirrored_over_two_devices_equals_one_device(tmp_path):
    # SGD, so that the adapters themselves can be compared (Adam's update is the full-weight test's kernel);
    # accumulated and recomputed, with dropout, the base frozen on every device.
    done = subprocess.run([sys.executable, '-c', LORA, str(HOT), str(data(tmp_path))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    two, one = result['two'], result['one']
    assert two['replicas'] == 2 and two['frozen'] and one['frozen']
    np.testing.assert_allclose(two['losses'], one['losses'], rtol=1e-4)  # float32 sums in another order
    assert abs(one['losses'][-1] - one['losses'][0]) > 1e-3  # the adapters learned something
    reference = np.array(one['logits'])
    assert np.abs(np.array(two['logits']) - reference).max() <= 1e-3 * max(1.0, np.abs(reference).max())
    for name, (a, b) in one['adapters'].items():
        assert np.abs(np.array(b)).max() > 1e-3, name  # B moved from zero
        np.testing.assert_allclose(two['adapters'][name][0], a, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(two['adapters'][name][1], b, rtol=1e-5, atol=1e-6, err_msg=name)


def cluster_env(ports, index):
    config = {'cluster': {'worker': [f'127.0.0.1:{p}' for p in ports]}, 'task': {'type': 'worker', 'index': index}}
    env = dict(os.environ, TF_CONFIG=json.dumps(config), TF_CPP_MIN_LOG_LEVEL='3')
    return env


def test_two_worker_processes_equal_one_process(tmp_path):
    path = data(tmp_path)
    ports = free_ports(2)
    workers = [subprocess.Popen([sys.executable, '-c', WORKER, str(HOT), str(path)], env=cluster_env(ports, i),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=600) for w in workers]  # the watchdog: no run waits longer
    finally:
        for w in workers:
            w.kill()
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    assert [r['replicas'] for r in results] == [2, 2]
    single = subprocess.run([sys.executable, '-c', WORKER.replace("make_strategy('multiworker', timeout=60)", 'None')
                             .replace('strategy.num_replicas_in_sync', '1'), str(HOT), str(path)],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    alone = json.loads(single.stdout.splitlines()[-1])['losses']
    for r in results:
        np.testing.assert_allclose(r['losses'], alone, rtol=1e-4)


@pytest.mark.slow
def test_a_killed_worker_stops_the_others_clearly_and_the_run_resumes(tmp_path):
    (tmp_path / 'corpus.txt').write_text('alpha beta gamma delta epsilon zeta eta theta. ' * 200)
    ports = free_ports(2)
    command = [sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--model_dir', bundled_checkpoint(),
               '--steps', '400', '--batch_size', '2',
               '--accumulate_gradients', '1', '--save_every', '2', '--sample_every', '0', '--seed', '1',
               '--strategy', 'multiworker', '--collective_timeout', '15']
    logs = [open(tmp_path / f'worker{i}.log', 'w') for i in range(2)]
    workers = [subprocess.Popen(command, env=cluster_env(ports, i), cwd=tmp_path, stdout=logs[i],
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        while '[4 |' not in (tmp_path / 'worker0.log').read_text():
            assert time.monotonic() < deadline and workers[0].poll() is None, (tmp_path / 'worker0.log').read_text()
            time.sleep(0.5)
        workers[1].kill()
        killed_at = time.monotonic()
        code = workers[0].wait(timeout=180)
        noticed = time.monotonic() - killed_at
    finally:
        for w in workers:
            w.kill()
        for log in logs:
            log.close()
    chief = (tmp_path / 'worker0.log').read_text()
    assert code != 0
    assert 'the cluster stopped answering' in chief and 'resume' in chief, chief[-2000:]
    print(f'\nthe chief noticed the killed worker after {noticed:.1f} s')
    assert noticed < 120, noticed  # the collective timeout (15 s) bounds it, plus the step in flight
    saved = int((tmp_path / 'checkpoint' / 'run1' / 'counter').read_text())
    assert saved >= 4
    # Resume from the chief's last checkpoint (here on one process).
    resumed = subprocess.run([*command[:command.index('--strategy')], '--steps', '2'] , cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f'(step {saved})' in resumed.stdout and f'[{saved + 2} |' in resumed.stdout


def test_a_worker_whose_peer_never_starts_gives_up_clearly(tmp_path):
    (tmp_path / 'corpus.txt').write_text('alpha beta gamma delta. ' * 100)
    command = [sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--model_dir', bundled_checkpoint(),
               '--steps', '2', '--strategy', 'multiworker', '--collective_timeout', '10']
    start = time.monotonic()
    done = subprocess.run(command, env=cluster_env(free_ports(2), 0), cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)  # the watchdog
    waited = time.monotonic() - start
    print(f'\nthe lone worker gave up after {waited:.1f} s')
    assert done.returncode == -signal.SIGKILL
    assert 'did not come together within 10 s' in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize('text, message', [
    (None, '--strategy multiworker needs TF_CONFIG'),
    ('garbage', 'TF_CONFIG is not JSON'),
    ('{"task": {"type": "worker", "index": 0}}', 'TF_CONFIG needs "cluster"'),
    ('{"cluster": {"worker": ["a:1", "b:2"]}}', 'TF_CONFIG needs "task"'),
    ('{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "chief", "index": 0}}', 'TF_CONFIG needs "task"'),
    ('{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 3}}',
     r'task index must be an integer in \[0, 2\) for its 2 worker host\(s\), got 3'),
])
def test_a_bad_tf_config_is_one_line_naming_what_is_wrong(text, message):
    from gpt2_tf.distribute import check_tf_config
    from gpt2_tf.validate import GPT2Error

    with pytest.raises(GPT2Error, match=message) as refused:
        check_tf_config(text)
    assert '\n' not in str(refused.value)


def test_the_command_line_refuses_a_bad_tf_config_in_one_line(tmp_path):
    (tmp_path / 'corpus.txt').write_text('one two three four. ' * 100)
    env = dict(os.environ, TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 1}}')
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--model_name', 'test',
                           '--strategy', 'multiworker', '--steps', '1'], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith('gpt2-tf: error: TF_CONFIG'), \
        done.stderr


@pytest.mark.parametrize('multiworker', [False, True])
def test_a_device_error_on_one_host_is_not_taken_for_a_dead_cluster(multiworker):
    import types

    import tensorflow as tf

    from gpt2_tf import train

    error = tf.errors.InternalError

    def fails(batch):
        raise error(None, None, 'cuDNN launch failure')

    kind = tf.distribute.MultiWorkerMirroredStrategy
    strategy = kind.__new__(kind) if multiworker else tf.distribute.MirroredStrategy(['/CPU:0'])  # (no cluster)
    run = types.SimpleNamespace(sampler=types.SimpleNamespace(sample=lambda n: None),
                                config=types.SimpleNamespace(batch_size=1, accumulate_gradients=1),
                                trainer=types.SimpleNamespace(step=fails, steps=0), strategy=strategy)
    with pytest.raises(tf.errors.InternalError, match='cuDNN launch failure'):
        train.Run.step(run)
    error = tf.errors.UnavailableError  # what a collective raises when a peer has gone
    with pytest.raises(train.ClusterError if multiworker else tf.errors.UnavailableError,
                       match='the cluster stopped answering' if multiworker else 'cuDNN'):
        train.Run.step(run)


@pytest.mark.slow  # two workers, each starting TensorFlow
def test_workers_that_see_different_run_folders_are_refused_before_a_step(tmp_path):
    # Worker 0 finds a saved run at step 3; worker 1, with another working folder, finds none: the
    # checkpoint_dir is not shared. Training on would average gradients of two different models.
    (tmp_path / 'corpus.txt').write_text('alpha beta gamma delta epsilon zeta eta theta. ' * 200)
    folders = [tmp_path / 'w0', tmp_path / 'w1']
    run = folders[0] / 'checkpoint' / 'run1'
    run.mkdir(parents=True)
    folders[1].mkdir()
    for name in ('model.ckpt.data-00000-of-00001', 'model.ckpt.index'):
        shutil.copy(pathlib.Path(bundled_checkpoint()) / name, run / name.replace('model.ckpt', 'model-3'))
    shutil.copy(pathlib.Path(bundled_checkpoint()) / 'hparams.json', run)
    (run / 'checkpoint').write_text('model_checkpoint_path: "model-3"\n')
    ports = free_ports(2)
    command = [sys.executable, '-m', 'gpt2_tf.cli', 'finetune', str(tmp_path / 'corpus.txt'), '--model_dir',
               bundled_checkpoint(), '--steps', '1', '--batch_size', '2', '--accumulate_gradients', '1',
               '--sample_every', '0', '--strategy', 'multiworker', '--collective_timeout', '60']
    workers = [subprocess.Popen(command, env=cluster_env(ports, i), cwd=folders[i], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outputs = [w.communicate(timeout=300) for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, (_, err) in zip(workers, outputs):
        assert w.returncode == 2, err[-3000:]
        assert err.strip().splitlines()[-1].startswith('gpt2-tf: error: the workers start from different steps '
                                                       '(3, 0, one per replica)'), err[-3000:]
    assert not (run / 'model-4.index').exists()
