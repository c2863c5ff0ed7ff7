"""Fine-tuning, after nshepperd's train.py and gpt-2-simple: the same loss, optimizer and run folders, in TF2.

Read top to bottom: the data (load_dataset, Sampler), one training step
(Trainer.step: a compiled function of the variables, the optimizer state and a
batch), checkpoints (Trainer.save/restore, in gpt-2-simple's run folder
layout), and the loop that logs, samples, validates and saves (finetune).
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from . import checkpoint, loading, validate
from .assets import bundled_vocabulary
from .checkpoint import CheckpointError
from .encoder import END_OF_TEXT, Encoder
from .hparams import HParams
from .model import Model
from .scoring import mean_loss, score

OPTIMIZERS = ('adam', 'sgd')
BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8  # tf.compat.v1.train.AdamOptimizer's defaults, which the original used


# --- data ----------------------------------------------------------------------------------------

def _files(path: str) -> list:
    if os.path.isdir(path):
        return sorted(p for p in glob.glob(os.path.join(glob.escape(path), '**', '*'), recursive=True)
                      if os.path.isfile(p) and not os.path.basename(p).startswith('.'))
    if os.path.isfile(path):
        return [path]
    return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))


def load_dataset(path: str, encoder: Encoder, combine: int = 50000, *, progress: Optional[Callable] = None) -> list:
    """Token chunks (int32 arrays) from a text file, a folder or glob of files, or an .npz of token arrays.

    An .npz (gpt-2-simple's encode_dataset output) loads as is. Text files are
    split into documents at lines that are exactly <|endoftext|>, and every
    document is followed by the end-of-text token 50256, as GPT-2 was trained
    (gpt-2-simple instead encoded that line as seven ordinary tokens).
    Documents are gathered into chunks of at least `combine` characters before
    encoding, as gpt-2-simple does; training windows never cross chunks.
    """
    files = _files(path)
    if not files:
        raise FileNotFoundError(f'no dataset at {path}: give a text file, a folder, a glob, or an .npz')
    chunks = []
    if len(files) == 1 and files[0].endswith('.npz'):
        with np.load(files[0]) as npz:
            chunks = [np.asarray(npz[name]) for name in npz.files]
    else:
        end = encoder.encoder[END_OF_TEXT]
        pending, size = [], 0

        def flush():
            nonlocal pending, size
            if pending:
                ids = []
                for document in pending:
                    ids.extend(encoder.encode(document))
                    ids.append(end)
                chunks.append(np.asarray(ids, np.int32))
            pending, size = [], 0

        for file in files:
            try:
                with open(file, encoding='utf-8') as f:
                    text = f.read()
            except UnicodeDecodeError:
                raise ValueError(f'{file}: not UTF-8 text; datasets are text files or an .npz of tokens') from None
            documents = [d.strip('\n') for d in text.split(f'\n{END_OF_TEXT}\n')]
            for document in documents:
                if document.strip():
                    pending.append(document)
                    size += len(document)
                    if size >= combine:
                        flush()
            if progress:
                progress(1)
        flush()
    chunks = [c for c in chunks if c.size]
    if not chunks:
        raise ValueError(f'the dataset at {path} is empty: no tokens in it')
    for chunk in chunks:
        validate.token_array(chunk, name='dataset tokens')
        validate.check_token_ids(chunk, encoder.n_vocab, name='dataset token')
    return [c.astype(np.int32) for c in chunks]


class Sampler:
    """Random training windows of exactly `length` tokens, within one chunk each, reproducible from a seed."""

    def __init__(self, chunks: list, length: int, seed: Optional[int] = None):
        self.chunks = [c for c in chunks if len(c) >= length]
        if not self.chunks:
            longest = max(len(c) for c in chunks)
            raise ValueError(f'the dataset is shorter than one training window: its longest chunk has {longest} '
                             f'tokens, and a window is n_ctx = {length}; give more text')
        self.length = length
        # A window starts at any of the len - length + 1 offsets of a chunk, each equally likely.
        self.starts = np.cumsum([len(c) - length + 1 for c in self.chunks])
        self.rng = np.random.default_rng(seed)

    def sample(self, batch: int) -> np.ndarray:  # -> int32 [batch, length]
        rows = []
        for pick in self.rng.integers(0, self.starts[-1], size=batch):
            i = bisect.bisect_right(self.starts, pick)
            offset = pick - (self.starts[i - 1] if i else 0)
            rows.append(self.chunks[i][offset:offset + self.length])
        return np.stack(rows)


# --- one training step ---------------------------------------------------------------------------

class Trainer:
    """One optimizer update per step, equal to the original training graph's.

    optimizer='adam' is tf.compat.v1.train.AdamOptimizer's update rule exactly
    (beta1 0.9, beta2 0.999, epsilon 1e-8, bias correction folded into the step
    size), through the same kernel; 'sgd' is plain gradient descent.
    accumulate_gradients=k splits each batch into k equal micro-batches and
    applies their mean gradient: the whole batch's update at a fraction of the
    memory. recompute=True recomputes each block's activations in the backward
    pass (tf.recompute_grad around each block, from outside the model).
    only_train_transformer_layers=True trains the h* blocks only.
    """

    def __init__(self, model: Model, learning_rate: float = 1e-4, optimizer: str = 'adam',
                 accumulate_gradients: int = 1, recompute: bool = False,
                 only_train_transformer_layers: bool = False, *, jit_compile: bool = False):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f'optimizer must be one of {OPTIMIZERS}, got {optimizer!r}')
        if not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
            raise ValueError(f'learning_rate must be > 0, got {learning_rate!r}')
        if not validate.is_int(accumulate_gradients) or accumulate_gradients < 1:
            raise ValueError(f'accumulate_gradients must be an integer >= 1, got {accumulate_gradients!r}')
        if model.dtype != 'float32':
            raise ValueError(f'fine-tuning needs float32 weights; this model holds {model.dtype} '
                             f'(load it with dtype="float32")')
        self.model = model
        self.learning_rate = float(learning_rate)
        self.optimizer = optimizer
        self.accumulate = accumulate_gradients
        self.recompute = recompute
        names = sorted(model.variables_by_name())
        self.names = [n for n in names if '/h' in n] if only_train_transformer_layers else names
        by_name = model.variables_by_name()
        self.variables = [by_name[n] for n in self.names]
        self.steps = 0  # updates applied, the run's counter
        self.strategy = model.strategy  # data-parallel when load_model created the model under a strategy
        # Optimizer state, named after the variables it shadows, as TF1's Adam names its slots.
        self.slots = {}
        if optimizer == 'adam':
            with model.on_device(), self.strategy.scope() if self.strategy else contextlib.nullcontext():
                self.slots = {f'{n}/{slot}': tf.Variable(tf.zeros_like(v), trainable=False, name=f'{n}/{slot}')
                              for n, v in zip(self.names, self.variables) for slot in ('Adam', 'Adam_1')}
                self.slots['beta1_power'] = tf.Variable(BETA1, trainable=False, name='beta1_power')
                self.slots['beta2_power'] = tf.Variable(BETA2, trainable=False, name='beta2_power')
        self._step = tf.function(self._update, jit_compile=jit_compile, autograph=False)

    def _gradients(self, tokens):
        """tokens [batch, T] -> (mean loss, mean gradients) over `accumulate` micro-batches, one at a time."""
        wrap = (lambda block: tf.recompute_grad(lambda h: block(h)[0])) if self.recompute else None
        k = self.accumulate
        if k == 1:
            with tf.GradientTape() as tape:
                loss = mean_loss(self.model, tokens, wrap=wrap)
            return loss, tape.gradient(loss, self.variables)
        micro = tf.reshape(tokens, [k, -1, tf.shape(tokens)[1]])  # [k, batch / k, T]

        def one(i, loss, grads):
            with tf.GradientTape() as tape:
                part = mean_loss(self.model, micro[i], wrap=wrap)
            new = tape.gradient(part, self.variables)
            return i + 1, loss + part, [g + n for g, n in zip(grads, new)]

        zeros = [tf.zeros_like(v) for v in self.variables]
        _, loss, grads = tf.while_loop(lambda i, *_: i < k, one, [tf.constant(0), tf.constant(0.0), zeros],
                                       parallel_iterations=1)  # one micro-batch's activations at a time
        return loss / k, [g / k for g in grads]

    def _apply(self, grads) -> None:
        """One update of every trained variable (of this replica's copy, under a strategy) by raw kernels."""
        lr = tf.constant(self.learning_rate)
        if self.optimizer == 'sgd':
            for v, g in zip(self.variables, grads):
                tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=lr, delta=g)
            return
        b1, b2 = self.slots['beta1_power'], self.slots['beta2_power']
        powers = [tf.raw_ops.ReadVariableOp(resource=b.handle, dtype=tf.float32) for b in (b1, b2)]
        updates = [tf.raw_ops.ResourceApplyAdam(
            var=v.handle, m=self.slots[f'{name}/Adam'].handle, v=self.slots[f'{name}/Adam_1'].handle,
            beta1_power=powers[0], beta2_power=powers[1], lr=lr, beta1=BETA1, beta2=BETA2, epsilon=EPSILON, grad=g)
            for name, v, g in zip(self.names, self.variables, grads)]
        with tf.control_dependencies(updates):  # after every variable's update, as TF1's Adam does in _finish
            for b, power, beta in ((b1, powers[0], BETA1), (b2, powers[1], BETA2)):
                tf.raw_ops.AssignVariableOp(resource=b.handle, value=power * beta)

    def _update(self, tokens):
        if self.strategy is None:
            loss, grads = self._gradients(tokens)
            self._apply(grads)
            return loss

        def replica(tokens):  # every replica sees the global batch and takes its own slice of it
            context = tf.distribute.get_replica_context()
            rows = tf.shape(tokens)[0] // context.num_replicas_in_sync
            start = tf.cast(context.replica_id_in_sync_group, tf.int32) * rows
            loss, grads = self._gradients(tokens[start:start + rows])
            reduced = context.all_reduce(tf.distribute.ReduceOp.MEAN, [loss] + grads)  # equal slices: the batch's mean
            self._apply(reduced[1:])
            return reduced[0]

        return self.strategy.experimental_local_results(self.strategy.run(replica, args=(tokens,)))[0]

    def step(self, tokens) -> float:
        """ONE optimizer update on tokens int32 [batch, T]; returns the batch's mean loss before it."""
        tokens = self.model.check_inputs(tokens)
        if tokens.shape[1] < 2:
            raise ValueError(f'training needs at least 2 tokens per row, got {tokens.shape[1]}')
        replicas = self.strategy.num_replicas_in_sync if self.strategy else 1
        if tokens.shape[0] % (self.accumulate * replicas):
            raise ValueError(f'batch of {tokens.shape[0]} rows does not split into accumulate_gradients='
                             f'{self.accumulate} equal micro-batches' + (f' on each of {replicas} replicas'
                                                                         if replicas > 1 else ''))
        with self.model.on_device():
            loss = float(self._step(tf.constant(tokens, tf.int32)))
        self.steps += 1
        return loss

    @property
    def tracing_count(self) -> int:
        return self._step.experimental_get_tracing_count()

    # --- checkpoints: gpt-2-simple's run folder -----------------------------------------------------

    def save(self, run_dir: str, *, max_checkpoints: int = 1, vocabulary=None) -> str:
        """Writes model-<step> (the model alone, loadable by load_model and the original code),
        optimizer-<step> beside it, `counter`, hparams.json and the vocabulary. Returns the model prefix.

        The `checkpoint` file switches to the new step only once its files are
        complete, so an interrupted save leaves the previous step loadable.
        """
        os.makedirs(run_dir, exist_ok=True)
        name = f'model-{self.steps}'
        if self.slots:
            checkpoint.write_tensors(os.path.join(run_dir, f'optimizer-{self.steps}'),
                                     {n: v.read_value() for n, v in self.slots.items()})
        _, before = checkpoint.checkpoint_state(run_dir)
        prefix = checkpoint.save_checkpoint(self.model, run_dir, name=name, keep=max_checkpoints)
        _, after = checkpoint.checkpoint_state(run_dir)
        for gone in set(before) - set(after):
            checkpoint.remove_bundle(os.path.join(run_dir, gone.replace('model-', 'optimizer-', 1)))
        checkpoint.replace_atomically(os.path.join(run_dir, 'counter'), f'{self.steps}\n')
        for target, source in zip(('encoder.json', 'vocab.bpe'), vocabulary or bundled_vocabulary()):
            if not os.path.exists(os.path.join(run_dir, target)):
                shutil.copyfile(source, os.path.join(run_dir, target))
        return prefix

    def restore(self, run_dir: str) -> None:
        """Loads the run's latest model-<step>, its optimizer state when saved, and the step counter.

        A gpt-2-simple run folder has no optimizer state: Adam's moments then start at zero.
        """
        prefix = checkpoint.find_checkpoint(run_dir)
        checkpoint.restore(self.model, prefix)
        step = os.path.basename(prefix).rsplit('-', 1)[-1]
        counter = os.path.join(run_dir, 'counter')
        if os.path.exists(counter):
            with open(counter, encoding='utf-8') as f:
                self.steps = int(f.read().strip() or 0)
        elif step.isdigit():
            self.steps = int(step)
        state = os.path.join(run_dir, f'optimizer-{step}')
        if self.slots and os.path.exists(state + '.index'):
            reader = tf.train.load_checkpoint(state)
            for name, variable in self.slots.items():
                variable.assign(reader.get_tensor(name))
        else:  # as a fresh TF1 AdamOptimizer starts, whatever the step counter says
            for name, variable in self.slots.items():
                fresh = {'beta1_power': BETA1, 'beta2_power': BETA2}.get(name)
                variable.assign(tf.zeros_like(variable) if fresh is None else fresh)


# --- several devices or hosts ----------------------------------------------------------------------

STRATEGIES = ('mirrored', 'multiworker')


def make_strategy(kind: str, *, timeout: float = 300.0):
    """A tf.distribute strategy for Trainer: 'mirrored' over this host's GPUs (or its logical CPUs when it
    has none), 'multiworker' over the hosts that TF_CONFIG names.

    timeout bounds every collective (seconds): a worker that dies is noticed after that long at most,
    instead of after TensorFlow's default of never. A worker that never starts: after `timeout` the waiting
    process prints a one-line error and is killed (SIGKILL: TensorFlow's wait cannot be interrupted).
    """
    if kind not in STRATEGIES:
        raise ValueError(f'strategy must be one of {STRATEGIES}, got {kind!r}')
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    if kind == 'multiworker':
        if not os.environ.get('TF_CONFIG'):
            raise ValueError('--strategy multiworker needs TF_CONFIG: the cluster and this worker\'s place in it')
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
    resolver = getattr(strategy, 'cluster_resolver', None)
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not cluster:
        return True
    return resolver.task_type == 'chief' or (resolver.task_type == 'worker' and resolver.task_id == 0
                                              and 'chief' not in cluster)


# --- the loop ------------------------------------------------------------------------------------

def validation_loss(model: Model, batches: list) -> float:
    """The mean loss over fixed batches, through scoring's own log-probs (the training loss's code)."""
    losses = [-np.mean(score(model, batch)) for batch in batches]
    return float(np.mean(losses))


def finetune(model_dir: str, dataset, *, steps: int = -1, run_name: str = 'run1', checkpoint_dir: str = 'checkpoint',
             learning_rate: float = 1e-4, batch_size: int = 1, accumulate_gradients: int = 5,
             sample_every: int = 100, sample_length: int = 1023, sample_num: int = 1, save_every: int = 1000,
             print_every: int = 1, max_checkpoints: int = 1, restore_from: str = 'latest',
             only_train_transformer_layers: bool = False, optimizer: str = 'adam', val_dataset=None,
             val_every: int = 0, val_batch_size: int = 2, val_batch_count: int = 40, combine: int = 50000,
             recompute: bool = False, seed: Optional[int] = None, sample_dir: str = 'samples',
             log: Callable[[str], None] = print, stop: Optional[Callable[[int], bool]] = None,
             strategy=None) -> Trainer:
    """Fine-tunes the model in model_dir on dataset; checkpoints go to checkpoint_dir/run_name.

    The options are gpt-2-simple's, with its defaults. batch_size is the
    micro-batch: each update draws batch_size * accumulate_gradients windows of
    n_ctx tokens. steps=-1 trains until interrupted. restore_from='latest'
    resumes the run folder when it has a checkpoint (else starts from
    model_dir); 'fresh' starts from model_dir. Ctrl-C saves and returns. stop,
    when given, is asked after each step whether to stop there (tests use it).
    strategy (make_strategy) trains data-parallel: every worker draws the same
    seeded global batch and its replicas take their slices; only the chief logs,
    samples and writes checkpoints (on several hosts, checkpoint_dir must be
    shared storage for restore_from='latest' to find them).
    """
    from .encoder import encoder_for
    from .sample import sample_sequence

    for name, value in (('batch_size', batch_size), ('accumulate_gradients', accumulate_gradients),
                        ('max_checkpoints', max_checkpoints), ('sample_num', sample_num)):
        if not validate.is_int(value) or value < 1:
            raise ValueError(f'{name} must be an integer >= 1, got {value!r}')
    if restore_from not in ('latest', 'fresh'):
        raise ValueError(f"restore_from must be 'latest' or 'fresh', got {restore_from!r}")
    run_dir = os.path.join(checkpoint_dir, run_name)
    resume = restore_from == 'latest' and os.path.exists(os.path.join(run_dir, 'checkpoint'))
    chief = strategy is None or is_chief(strategy)
    if not chief:
        log = lambda line: None  # noqa: E731  (the chief speaks for the cluster)
    base = loading.load_model(model_dir, strategy=strategy)
    if resume:
        run_hparams = HParams.from_json(os.path.join(run_dir, 'hparams.json'))
        if run_hparams != base.hparams:
            raise CheckpointError(f'{run_dir} holds a run of another model size ({run_hparams}); use another '
                                  f'--run_name, or the base model it was trained from')
    encoder = encoder_for(model_dir)
    chunks = dataset if isinstance(dataset, list) else load_dataset(dataset, encoder, combine)
    n_ctx = base.hparams.n_ctx
    sampler = Sampler(chunks, n_ctx, seed)
    validation = []
    if val_dataset is not None and val_every > 0:
        val_chunks = val_dataset if isinstance(val_dataset, list) else load_dataset(val_dataset, encoder, combine)
        val_sampler = Sampler(val_chunks, n_ctx, seed=0 if seed is None else seed + 1)
        validation = [val_sampler.sample(val_batch_size) for _ in range(val_batch_count)]  # fixed batches
    trainer = Trainer(base, learning_rate, optimizer, accumulate_gradients, recompute, only_train_transformer_layers)
    if resume:
        trainer.restore(run_dir)
        log(f'Loading checkpoint {checkpoint.find_checkpoint(run_dir)} (step {trainer.steps})')
    vocabulary = [os.path.join(model_dir, f) for f in ('encoder.json', 'vocab.bpe')]
    vocabulary = vocabulary if all(map(os.path.exists, vocabulary)) else None

    def save():
        if not chief:
            return
        try:
            prefix = trainer.save(run_dir, max_checkpoints=max_checkpoints, vocabulary=vocabulary)
        except OSError as e:
            current, _ = checkpoint.checkpoint_state(run_dir)
            raise OSError(e.errno, f'cannot save step {trainer.steps} in {run_dir} ({e.strerror}); the previous '
                                   f'checkpoint ({current or "none"}) is intact') from None
        log(f'Saving {prefix}')

    def generate_samples():
        if not chief:
            return
        length = min(sample_length, n_ctx)
        out = sample_sequence(base, length, start_token=encoder.encoder[END_OF_TEXT], batch_size=sample_num,
                              seed=None if seed is None else (seed, trainer.steps))
        texts = [encoder.decode(row[1:]) for row in out]
        folder = os.path.join(sample_dir, run_name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f'samples-{trainer.steps}'), 'w', encoding='utf-8') as f:
            f.write(('\n' + '=' * 20 + '\n').join(texts))
        for text in texts:
            log('======== SAMPLE ========\n' + text)

    start, average = time.time(), None
    first = trainer.steps
    try:
        while steps < 0 or trainer.steps - first < steps:
            if val_every > 0 and validation and trainer.steps % val_every == 0:
                log(f'[{trainer.steps} | {time.time() - start:.2f}] validation loss = '
                    f'{validation_loss(base, validation):.4f}')
            try:
                loss = trainer.step(sampler.sample(batch_size * accumulate_gradients))
            except tf.errors.OpError as e:
                if strategy is None:
                    raise
                raise RuntimeError(
                    f'step {trainer.steps + 1}: the cluster stopped answering ({type(e).__name__}: '
                    f'{e.message.strip().splitlines()[0][:200]}); rerun every worker with --restore_from latest '
                    f'to resume from the chief\'s last checkpoint') from None
            average = loss if average is None else 0.99 * average + 0.01 * loss
            if trainer.steps % print_every == 0:
                log(f'[{trainer.steps} | {time.time() - start:.2f}] loss={loss:.4f} avg={average:.4f}')
            if save_every > 0 and trainer.steps % save_every == 0:
                save()
            if sample_every > 0 and trainer.steps % sample_every == 0:
                generate_samples()
            if stop is not None and stop(trainer.steps):
                break
    except KeyboardInterrupt:
        log('interrupted')
    save()
    return trainer


def encode_dataset(path: str, out_path: str, encoder: Encoder, combine: int = 50000) -> int:
    """Encodes a text dataset to an .npz of token chunks (gpt-2-simple's format); returns the token count."""
    chunks = load_dataset(path, encoder, combine)
    np.savez_compressed(out_path, *chunks)
    return int(sum(c.size for c in chunks))
