"""Several devices or hosts for fine-tuning: the strategy, a watchdog on the cluster's start, the chief.

make_strategy builds the tf.distribute strategy a Trainer runs its step under;
is_chief says which process of a cluster writes checkpoints and samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import tensorflow as tf

from .train_config import STRATEGIES, check_choice, check_timeout
from .validate import GPT2Error, first_line, is_int


def make_strategy(kind: str, *, timeout: float = 300.0):
    """A tf.distribute strategy for Trainer: 'mirrored' over this host's GPUs (or its logical CPUs when it
    has none), 'multiworker' over the hosts that TF_CONFIG names.

    timeout bounds every collective (seconds): a worker that dies is noticed after that long at most,
    instead of after TensorFlow's default of never. A worker that never starts: after `timeout` the waiting
    process prints a one-line error and is killed (SIGKILL: TensorFlow's wait cannot be interrupted).
    """
    check_choice('strategy', kind, STRATEGIES)
    check_timeout(timeout)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    if kind == 'multiworker':
        check_tf_config(os.environ.get('TF_CONFIG'))
        # The constructor waits for every worker in TensorFlow code that holds the interpreter and ignores
        # signals, so a worker that never starts would hang the others: a watchdog process ends this one.
        with _deadline(timeout, f'gpt2-tf: error: the cluster in TF_CONFIG did not come together within '
                                f'{timeout:.0f} s: start every worker it names (or raise --collective_timeout)'):
            try:
                return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
            except (ValueError, tf.errors.OpError) as e:
                raise GPT2Error(f'TF_CONFIG: {first_line(e)}') from None
    devices = [d.name for d in tf.config.list_logical_devices('GPU')] or \
        [d.name for d in tf.config.list_logical_devices('CPU')]
    return tf.distribute.MirroredStrategy(devices)


EXAMPLE = '{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 0}}'


def check_tf_config(text) -> None:
    """TF_CONFIG names a cluster and this worker's place in it, or a one-line GPT2Error says what is wrong."""
    if not text:
        raise GPT2Error(f'--strategy multiworker needs TF_CONFIG: the cluster and this worker\'s place in it, '
                        f'e.g. {EXAMPLE}')
    try:
        config = json.loads(text)
    except ValueError as e:
        raise GPT2Error(f'TF_CONFIG is not JSON ({e}); write it as {EXAMPLE}') from None
    cluster = config.get('cluster') if isinstance(config, dict) else None
    task = config.get('task') if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not cluster or not all(isinstance(h, list) and h for h in cluster.values()):
        raise GPT2Error(f'TF_CONFIG needs "cluster": each kind of task with its list of host:port, as in {EXAMPLE}')
    if not isinstance(task, dict) or task.get('type') not in cluster:
        raise GPT2Error(f'TF_CONFIG needs "task": this worker\'s "type", one of {sorted(cluster)}, and "index"')
    hosts = cluster[task['type']]
    if not is_int(task.get('index')) or not 0 <= task['index'] < len(hosts):
        raise GPT2Error(f'TF_CONFIG\'s task index must be an integer in [0, {len(hosts)}) for its '
                        f'{len(hosts)} {task["type"]} host(s), got {task.get("index")!r}')


_WATCHDOG = """
import os, select, signal, sys
parent, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if not ready:  # neither released nor orphaned: the parent is still waiting
    sys.stderr.write(message + '\\n')
    sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)
"""


@contextlib.contextmanager
def _deadline(seconds: float, message: str):
    """End this process with `message` on stderr if the block has not finished after `seconds`."""
    watchdog = subprocess.Popen([sys.executable, '-c', _WATCHDOG, str(os.getpid()), str(seconds), message],
                                stdin=subprocess.PIPE)
    try:
        yield
    finally:
        watchdog.stdin.close()  # releases it
        watchdog.wait()


def check_same_step(strategy, step: int, run_dir: str) -> None:
    """On several hosts, every worker must start from the same step (each resumes from the run folder it
    sees): a worker that cannot see the chief's checkpoints would train other weights. One collective."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    steps = strategy.gather(strategy.run(lambda: tf.constant([step], tf.int64)), axis=0).numpy().tolist()
    if len(set(steps)) > 1:
        raise GPT2Error(f'the workers start from different steps ({", ".join(map(str, steps))}, one per replica): '
                        f'each resumes from {run_dir} as it sees it, so --checkpoint_dir must be storage every '
                        f'worker shares; rerun every worker with it (or with --restore_from fresh)')


def is_chief(strategy) -> bool:
    """Whether this process writes checkpoints and samples: always without a cluster, else the chief
    (or worker 0 when the cluster has no chief)."""
    if strategy is None:
        return True
    resolver = getattr(strategy, 'cluster_resolver', None)
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not cluster:
        return True
    return resolver.task_type == 'chief' or (resolver.task_type == 'worker' and resolver.task_id == 0
                                              and 'chief' not in cluster)
