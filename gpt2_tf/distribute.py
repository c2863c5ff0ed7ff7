"""Several devices or hosts for fine-tuning: the strategy, a watchdog on the cluster's start, the chief.

make_strategy builds the tf.distribute strategy a Trainer runs its step under;
is_chief says which process of a cluster writes checkpoints and samples.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import tensorflow as tf

from .train_config import STRATEGIES, check_choice, check_positive
from .validate import GPT2Error


def make_strategy(kind: str, *, timeout: float = 300.0):
    """A tf.distribute strategy for Trainer: 'mirrored' over this host's GPUs (or its logical CPUs when it
    has none), 'multiworker' over the hosts that TF_CONFIG names.

    timeout bounds every collective (seconds): a worker that dies is noticed after that long at most,
    instead of after TensorFlow's default of never. A worker that never starts: after `timeout` the waiting
    process prints a one-line error and is killed (SIGKILL: TensorFlow's wait cannot be interrupted).
    """
    check_choice('strategy', kind, STRATEGIES)
    check_positive('collective_timeout', timeout)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    if kind == 'multiworker':
        if not os.environ.get('TF_CONFIG'):
            raise GPT2Error('--strategy multiworker needs TF_CONFIG: the cluster and this worker\'s place in it')
        # The constructor waits for every worker in TensorFlow code that holds the interpreter and ignores
        # signals, so a worker that never starts would hang the others: a watchdog process ends this one.
        with _deadline(timeout, f'gpt2-tf: error: the cluster in TF_CONFIG did not come together within '
                                f'{timeout:.0f} s: start every worker it names (or raise --collective_timeout)'):
            return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    devices = [d.name for d in tf.config.list_logical_devices('GPU')] or \
        [d.name for d in tf.config.list_logical_devices('CPU')]
    return tf.distribute.MirroredStrategy(devices)


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
