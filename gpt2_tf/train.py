"""Fine-tuning, after nshepperd's train.py and gpt-2-simple: the same loss, optimizer and run folders, in TF2.

Read top to bottom: one training step (Trainer.step: a compiled function of
the variables, the optimizer state and a batch), then the loop that logs,
validates, saves and samples (finetune, over a Run). Each other job has its
own module: the options and their defaults (train_config.FinetuneConfig), the
data (dataset: a token file's windows read in place, token_windows; or
gpt-2-simple's chunks, load_dataset and Sampler), the run folder's files (runfolder:
save, restore) and several devices or hosts (distribute: make_strategy,
is_chief). Their names are importable from here too, as they always were.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from . import checkpoint, interrupts, kernels, loading, lora, runfolder
from .checkpoint import CheckpointError
from .dataset import Sampler, encode_dataset, is_token_file, load_dataset, needs_vocabulary, token_windows  # noqa: F401
from .distribute import check_same_step, is_chief, make_strategy  # noqa: F401
from .encoder import encoder_for
from .runtime import Model
from .sample import sample_sequence
from .scoring import mean_loss, score
from .train_config import (OPTIMIZERS, STRATEGIES, FinetuneConfig, check_optimizer, check_positive,  # noqa: F401
                           configure)
from .validate import GPT2Error, first_line

BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8  # tf.compat.v1.train.AdamOptimizer's defaults, which the original used
# Adafactor (Shazeer and Stern 2018, Algorithm 4 without the first moment): the second moments' decay 1 - t^-0.8,
# epsilon1 added to g², updates clipped to RMS 1. The learning rate is absolute, as for Adam, not relative to
# the weights' scale.
DECAY_POWER, EPSILON1, CLIP = 0.8, 1e-30, 1.0


# --- one training step ---------------------------------------------------------------------------

class Diverged(GPT2Error):
    """A step's loss or a gradient was not finite: its update was not applied, the model is the step before."""


def recomputed(block):
    """The block as h -> h with each half's activations recomputed in the backward pass (Block.halves):
    a half's backward then runs only what its gradients read, so frozen products whose outputs only the
    next half reads are not recomputed."""
    halves = [tf.recompute_grad(half) for half in block.halves()]
    return lambda h: functools.reduce(lambda x, half: half(x), halves, h)


class Trainer:
    """One optimizer update per step, equal to the original training graph's.

    optimizer='adam' is tf.compat.v1.train.AdamOptimizer's update rule exactly
    (beta1 0.9, beta2 0.999, epsilon 1e-8, bias correction folded into the step
    size), through the same kernel; 'sgd' is plain gradient descent;
    'adafactor' keeps a row and a column mean of g² per matrix instead of
    Adam's two full moments (see DECAY_POWER).
    accumulate_gradients=k splits each batch into k equal micro-batches and
    applies their mean gradient: the whole batch's update at a fraction of the
    memory (1 here: the step itself; finetune's default is FinetuneConfig's).
    recompute=True recomputes each block's activations in the backward pass
    (tf.recompute_grad around each half block, from outside the model; LoRA's
    backward then skips the frozen products whose outputs only the next half reads). Only the
    trained variables are watched: no gradient of a frozen weight is formed.
    A step's products are TensorFlow's ops (kernels.tensorflow_ops: the C++
    kernels for int8 weights and few float32 rows have no gradient); its
    causal attention keeps the kernel's op, which has one.
    only_train_transformer_layers=True trains the h* blocks only.
    lora_rank=R > 0 trains LoRA adapters of rank R on the lora_targets
    products (gpt2_tf.lora) and nothing else: the base weights stay frozen,
    in their dtype; the run folder holds the adapter in PEFT's format, made
    for base_model (its adapter_config.json's base_model_name_or_path).
    """

    def __init__(self, model: Model, learning_rate: float = FinetuneConfig.learning_rate,
                 optimizer: str = FinetuneConfig.optimizer, accumulate_gradients: int = 1,
                 recompute: bool = FinetuneConfig.recompute,
                 only_train_transformer_layers: bool = FinetuneConfig.only_train_transformer_layers, *,
                 jit_compile: bool = False, lora_rank: int = FinetuneConfig.lora_rank,
                 lora_alpha: Optional[float] = FinetuneConfig.lora_alpha,
                 lora_targets: str = FinetuneConfig.lora_targets, lora_dropout: float = FinetuneConfig.lora_dropout,
                 base_model: str = '', seed: Optional[int] = None):
        check_optimizer(learning_rate, optimizer, accumulate_gradients)
        if model.dtype != 'float32' and not lora_rank:  # LoRA reads the frozen base only, in any dtype
            raise GPT2Error(f'full fine-tuning needs float32 weights; this model holds {model.dtype} (load it '
                            f'with dtype="float32", or train LoRA adapters over it with lora_rank)')
        self.model = model
        self.learning_rate = learning_rate
        self.optimizer = optimizer
        self.accumulate = accumulate_gradients
        self.recompute = recompute
        self.adapters = lora.attach(model, rank=lora_rank, alpha=lora_alpha, targets=lora_targets,
                                    dropout=lora_dropout, seed=seed) if lora_rank else {}  # seed: A's draw
        self.lora_config = lora_rank and lora.peft_config(
            rank=lora_rank, alpha=2 * lora_rank if lora_alpha is None else lora_alpha, targets=lora_targets,
            dropout=lora_dropout, base=base_model)
        by_name = model.variables_by_name()
        trained = ((lambda n: '/lora/' in n) if self.adapters
                   else (lambda n: '/h' in n or not only_train_transformer_layers))
        self.names = sorted(filter(trained, by_name))
        self.variables = [by_name[n] for n in self.names]
        self.wte_trained = any(v is model.wte for v in self.variables)  # if not, the loss never holds the logits
        self.steps = 0  # updates applied, the run's counter
        self.strategy = model.strategy  # data-parallel when load_model created the model under a strategy
        self.slots = self._create_slots()
        self._step = tf.function(self._update, jit_compile=jit_compile, autograph=False)

    @property
    def learning_rate(self) -> float:
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        """Checked here, and taken by the next step (a schedule may set it between steps)."""
        check_positive('learning_rate', value)
        self._learning_rate = float(value)

    def _create_slots(self) -> dict:
        """The optimizer state, named after the variables it shadows, as TF1's Adam names its slots."""
        if self.optimizer == 'sgd':
            return {}
        with self.model.on_device(), self.strategy.scope() if self.strategy else contextlib.nullcontext():
            if self.optimizer == 'adafactor':
                return adafactor_slots(self.names, self.variables)
            slots = {f'{n}/{slot}': tf.Variable(tf.zeros_like(v), trainable=False, name=f'{n}/{slot}')
                     for n, v in zip(self.names, self.variables) for slot in ('Adam', 'Adam_1')}
            slots['beta1_power'] = tf.Variable(BETA1, trainable=False, name='beta1_power')
            slots['beta2_power'] = tf.Variable(BETA2, trainable=False, name='beta2_power')
        return slots

    def reset_slots(self) -> None:
        """The state a fresh TF1 AdamOptimizer starts from: zero moments, each beta power at its beta."""
        for name, variable in self.slots.items():
            fresh = {'beta1_power': BETA1, 'beta2_power': BETA2, 'adafactor_step': 0.0}.get(name)
            variable.assign(tf.zeros_like(variable) if fresh is None else fresh)

    def _gradients(self, tokens, replica=0):
        """tokens [batch, T] -> (mean loss, mean gradients) over `accumulate` micro-batches, one at a time;
        micro-batch i of replica r is part r·accumulate + i of the step (its own dropout masks)."""
        wrap = recomputed if self.recompute else None
        k = self.accumulate
        if k == 1:
            with lora.part(self.adapters, replica):
                with self._tape() as tape:
                    loss = mean_loss(self.model, tokens, wrap=wrap, wte_trained=self.wte_trained)
                return loss, tape.gradient(loss, self.variables)
        micro = tf.reshape(tokens, [k, -1, tf.shape(tokens)[1]])  # [k, batch / k, T]

        def one(i, loss, grads):
            with lora.part(self.adapters, replica * k + i):
                with self._tape() as tape:
                    part = mean_loss(self.model, micro[i], wrap=wrap, wte_trained=self.wte_trained)
                new = tape.gradient(part, self.variables)
            return i + 1, loss + part, [g + n for g, n in zip(grads, new)]

        zeros = [tf.zeros_like(v) for v in self.variables]
        _, loss, grads = tf.while_loop(lambda i, *_: i < k, one, [tf.constant(0), tf.constant(0.0), zeros],
                                       parallel_iterations=1)  # one micro-batch's activations at a time
        return loss / k, [g / k for g in grads]

    @contextlib.contextmanager
    def _tape(self):
        """A tape that watches the trained variables alone, not every variable the forward reads."""
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(self.variables)
            yield tape

    def _apply(self, grads, lr) -> None:
        """One update of every trained variable (of this replica's copy, under a strategy) by raw kernels."""
        if self.optimizer == 'sgd':
            for v, g in zip(self.variables, grads):
                tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=lr, delta=g)
            return
        if self.optimizer == 'adafactor':
            adafactor_update(self.names, self.variables, grads, self.slots, lr)
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

    def _update(self, tokens, lr):
        """One step -> (the batch's mean loss before it, bool []: whether its update was applied)."""
        if self.strategy is None:
            loss, grads = self._gradients(tokens)
            return loss, self._apply_if_finite(loss, grads, lr)

        def replica(tokens):  # every replica sees the global batch and takes its own slice of it
            context = tf.distribute.get_replica_context()
            rows = tf.shape(tokens)[0] // context.num_replicas_in_sync
            replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32)
            loss, grads = self._gradients(tokens[replica_id * rows:(replica_id + 1) * rows], replica_id)
            reduced = context.all_reduce(tf.distribute.ReduceOp.MEAN, [loss] + grads)  # equal slices: the batch's mean
            return reduced[0], self._apply_if_finite(reduced[0], reduced[1:], lr)  # the same on every replica

        return self.strategy.experimental_local_results(self.strategy.run(replica, args=(tokens,)))[0]

    def _apply_if_finite(self, loss, grads, lr):
        """Applies grads when the loss and every gradient are finite (the original would write NaN into every
        weight and optimizer slot); -> bool []: whether it did."""
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
        finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(x)) for x in [loss, *values]]))

        def apply():
            self._apply(grads, lr)
            return tf.constant(True)

        return tf.cond(finite, apply, lambda: tf.constant(False))

    def step(self, tokens) -> float:
        """ONE optimizer update on tokens int32 [batch, T]; returns the batch's mean loss before it. Raises
        Diverged, and changes nothing, when the loss or a gradient is not finite."""
        tokens = self.model.check_inputs(tokens)
        if tokens.shape[1] < 2:
            raise GPT2Error(f'training needs at least 2 tokens per row, got {tokens.shape[1]}')
        replicas = self.strategy.num_replicas_in_sync if self.strategy else 1
        if tokens.shape[0] % (self.accumulate * replicas):
            raise GPT2Error(f'batch of {tokens.shape[0]} rows does not split into accumulate_gradients='
                            f'{self.accumulate} equal micro-batches' + (f' on each of {replicas} replicas'
                                                                        if replicas > 1 else ''))
        # products trace as TensorFlow's ops, which have the activations' gradient (their kernels have none);
        # the attention keeps its kernel, which has one
        with interrupts.deferred():  # the update and its count together: a Ctrl-C takes effect after both
            with self.model.on_device(), lora.training(self.adapters), kernels.tensorflow_ops(products_only=True):
                loss, applied = self._step(tf.constant(tokens, tf.int32), tf.constant(self.learning_rate))
            loss = float(loss)
            if not applied:
                what = f'the loss is {loss}' if not np.isfinite(loss) else 'a gradient is not finite'
                raise Diverged(f'step {self.steps + 1}: {what}, so its update was not applied (the model stays at '
                               f'step {self.steps}); lower the learning rate, or check the weights for NaN')
            self.steps += 1
            if self.adapters:
                next(iter(self.adapters.values())).counter.value.assign_add(1)  # one counter: the next step's masks
        return loss

    @property
    def tracing_count(self) -> int:
        return self._step.experimental_get_tracing_count()

    def save(self, run_dir: str, *, max_checkpoints: int = 1, vocabulary=None) -> str:
        """The model (or the adapter alone), the slots and the step into a run folder (runfolder.save,
        runfolder.save_adapter); returns the model's prefix (the adapter's file)."""
        if self.adapters:
            return runfolder.save_adapter(run_dir, self.model, self.adapters, self.lora_config, self.slots,
                                          self.steps, vocabulary=vocabulary)
        return runfolder.save(run_dir, self.model, self.slots, self.steps, max_checkpoints=max_checkpoints,
                              vocabulary=vocabulary)

    def restore(self, run_dir: str) -> None:
        """The run folder's latest step, checked (runfolder.restore); the slots start afresh when it has none."""
        if self.adapters:
            self.steps, restored = runfolder.restore_adapter(run_dir, self.model, self.adapters, self.slots)
            next(iter(self.adapters.values())).counter.value.assign(self.steps)  # the dropout masks go on
        else:
            self.steps, restored = runfolder.restore(run_dir, self.model, self.slots)
        if not restored:  # a gpt-2-simple run folder: as a fresh TF1 AdamOptimizer starts, whatever the step
            self.reset_slots()


def _terminated(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminated_as_interrupted():
    """SIGTERM (a job scheduler's stop, `kill`) inside the block acts as Ctrl-C: the run saves the step reached
    and stops. On the main thread, where SIGTERM has its default action."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def adafactor_slots(names: list, variables: list) -> dict:
    """Adafactor's state: for a matrix (the last two axes) the running means of g² over its rows
    (`/Adafactor_vr`, [..., nx]) and columns (`/Adafactor_vc`, [..., nf]); a full `/Adafactor_v` otherwise."""
    slots = {}
    for name, v in zip(names, variables):
        shape = v.shape.as_list()
        if len(shape) >= 2:
            slots[f'{name}/Adafactor_vr'] = tf.Variable(tf.zeros(shape[:-1]), trainable=False, name=f'{name}/vr')
            slots[f'{name}/Adafactor_vc'] = tf.Variable(tf.zeros(shape[:-2] + shape[-1:]), trainable=False,
                                                        name=f'{name}/vc')
        else:
            slots[f'{name}/Adafactor_v'] = tf.Variable(tf.zeros(shape), trainable=False, name=f'{name}/v')
    slots['adafactor_step'] = tf.Variable(0.0, trainable=False, name='adafactor_step')
    return slots


def adafactor_update(names: list, variables: list, grads: list, slots: dict, lr) -> None:
    """One Adafactor step of every variable: v̂ = vr·vcᵀ / mean(vr) for matrices, u = g / sqrt(v̂) clipped to
    RMS <= CLIP, w -= lr·u."""
    step = slots['adafactor_step'].assign_add(1.0)
    decay = 1.0 - tf.pow(step, -DECAY_POWER)  # 0 at step 1: the first step's moments are its own g²
    for name, v, g in zip(names, variables, grads):
        g2 = tf.square(g) + EPSILON1
        if f'{name}/Adafactor_v' in slots:
            second = slots[f'{name}/Adafactor_v'].assign(decay * slots[f'{name}/Adafactor_v'] + (1 - decay) * g2)
        else:
            vr, vc = slots[f'{name}/Adafactor_vr'], slots[f'{name}/Adafactor_vc']
            r = vr.assign(decay * vr + (1 - decay) * tf.reduce_mean(g2, axis=-1))  # [..., nx]
            c = vc.assign(decay * vc + (1 - decay) * tf.reduce_mean(g2, axis=-2))  # [..., nf]
            # r / mean(r) first: r·c of an all-zero gradient (LoRA's first A) is 1e-60, 0 in float32, and 0/0 NaN.
            second = (r / tf.reduce_mean(r, axis=-1, keepdims=True))[..., :, None] * c[..., None, :]
        u = g * tf.math.rsqrt(second)
        u = u / tf.maximum(1.0, tf.sqrt(tf.reduce_mean(tf.square(u))) / CLIP)
        v.assign_sub(lr * u)


# --- the loop ------------------------------------------------------------------------------------

PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError,
               tf.errors.AbortedError)  # a collective's, when a worker stopped answering


class ClusterError(GPT2Error, RuntimeError):
    """A worker of the cluster stopped answering mid-step; the run resumes from the chief's last checkpoint."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during finetune, or its log's reader gone (`| head`), raised once the run has saved its step (the
    command line exits 130)."""

    def __init__(self, trainer: Trainer, saved: bool = True, what: str = 'interrupted'):
        super().__init__(f'{what} at step {trainer.steps}, which is saved' if saved else
                         f'{what} at step {trainer.steps}, before this run\'s first step: the run folder is '
                         f'as it was')
        self.trainer = trainer


def validation_loss(model: Model, batches: list) -> float:
    """The mean loss over fixed batches, through scoring's own log-probs (the training loss's code)."""
    losses = [-np.mean(score(model, batch)) for batch in batches]
    return float(np.mean(losses))


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


class Run:
    """One fine-tuning run: the base model, its data, its Trainer, and what the loop writes where."""

    def __init__(self, model_dir: str, dataset, config: FinetuneConfig, *, strategy=None,
                 log: Callable[[str], None] = print):
        base = loading.resolve(model_dir)  # a folder, a name, or one save of a folder (checkpoint/run1/model-2)
        model_dir = base.path  # where its vocabulary is
        self.config, self.strategy = config, strategy
        self.run_dir = os.path.join(config.checkpoint_dir, config.run_name)
        self.chief = is_chief(strategy)
        self.log = log if self.chief else (lambda line: None)  # the chief speaks for the cluster
        saved = runfolder.is_adapter_run if config.lora_rank else runfolder.has_checkpoint
        resume = config.restore_from == 'latest' and saved(self.run_dir)
        if resume and base.checkpoint and os.path.samefile(os.path.dirname(base.checkpoint) or '.', self.run_dir):
            raise GPT2Error(f'{base.checkpoint} is a save of the run folder this run would resume (from its latest '
                            f'save): give --restore_from fresh to start a run there from it, or another --run_name')
        if not resume:  # a new run here must not mix with a run of the other kind
            runfolder.check_mode(self.run_dir, lora=bool(config.lora_rank))
        self.model = loading.load_model(base, strategy=strategy, dtype=config.dtype)
        self._check_folders()
        replicas = strategy.num_replicas_in_sync if strategy else 1
        if config.batch_size % replicas:
            raise GPT2Error(f'batch_size {config.batch_size} does not split over the {replicas} replicas of the '
                            f'strategy: give a multiple of {replicas} (--batch_size {replicas})')
        self.encoder = self._encoder(model_dir, dataset)
        self.sampler, self.validation = self._data(model_dir, dataset)
        self.trainer = Trainer(self.model, config.learning_rate, config.optimizer, config.accumulate_gradients,
                               config.recompute, config.only_train_transformer_layers, lora_rank=config.lora_rank,
                               lora_alpha=config.lora_alpha, lora_targets=config.lora_targets,
                               lora_dropout=config.lora_dropout, base_model=base.checkpoint or base.path,
                               seed=config.seed)
        if resume:
            self.trainer.restore(self.run_dir)
            # The windows go on where the run stopped: step k draws what it would have drawn uninterrupted.
            self.sampler.skip(self.trainer.steps, config.batch_size * config.accumulate_gradients)
            found = self.run_dir if config.lora_rank else checkpoint.find_checkpoint(self.run_dir)
            self.log(f'Loading checkpoint {found} (step {self.trainer.steps})')
        check_same_step(strategy, self.trainer.steps, self.run_dir)
        self.vocabulary = run_vocabulary(model_dir)
        self.saved = self.trainer.steps if resume else None  # the step the run folder holds, when known
        self.first = self.trainer.steps  # where loop() starts
        self._make_folders()

    def _check_folders(self) -> None:
        """Before the data is read: the run folder takes this model's size (fresh or resumed)."""
        checkpoint.refuse_hf_model(self.run_dir)  # as a save would, but before the first step
        held = os.path.join(self.run_dir, 'hparams.json')
        if os.path.exists(held) and runfolder.run_hparams(self.run_dir) != self.model.hparams:
            raise CheckpointError(f'{self.run_dir} holds a run of another model size '
                                  f'({runfolder.run_hparams(self.run_dir)}); use another --run_name, or the '
                                  f'base model it was trained from')

    def _make_folders(self) -> None:
        """Once all else is checked (a run refused for its data or options leaves no folder behind), before any
        step: the run folder and the sample folder exist and can be written (the chief's, which write them)."""
        folders = [('checkpoint_dir', self.run_dir)]
        if self.config.sample_every:
            folders.append(('sample_dir', os.path.join(self.config.sample_dir, self.config.run_name)))
        for option, folder in folders if self.chief else []:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                raise GPT2Error(f'cannot create {folder} ({e.strerror}): give --{option} a folder that can be '
                                f'written') from None

    def _encoder(self, model_dir: str, dataset):
        """The model folder's vocabulary (or the bundled one), unless the run needs none (needs_vocabulary)."""
        try:
            return encoder_for(model_dir)
        except GPT2Error:
            if needs_vocabulary(dataset, self.config):
                raise
            return None

    def _data(self, model_dir: str, dataset) -> tuple:
        """(the training sampler, the fixed validation batches, drawn once: [] for none)."""
        config, n_ctx = self.config, self.model.hparams.n_ctx
        val_seed = 0 if config.seed is None else config.seed + 1
        options = dict(n_vocab=self.model.hparams.n_vocab, model_dir=model_dir)
        if is_token_file(dataset):
            sampler, held_out = token_windows(dataset, n_ctx, seed=config.seed, val_fraction=config.val_fraction,
                                              val_seed=val_seed, **options)
        elif config.val_fraction:
            raise GPT2Error('val_fraction holds out documents of a token file; encode the dataset into one '
                            '(gpt2-tf encode DATASET train.bin) or give val_dataset')
        else:
            sampler, held_out = Sampler(self._chunks(dataset), n_ctx, config.seed), None
        if config.val_every == 0:
            return sampler, []
        if is_token_file(config.val_dataset):
            held_out, _ = token_windows(config.val_dataset, n_ctx, seed=val_seed, **options)
        elif config.val_dataset is not None:
            held_out = Sampler(self._chunks(config.val_dataset), n_ctx, val_seed)
        if held_out is None:
            return sampler, []
        return sampler, [held_out.sample(config.val_batch_size) for _ in range(config.val_batch_count)]

    def _chunks(self, dataset) -> list:
        return dataset if isinstance(dataset, list) else load_dataset(dataset, self.encoder, self.config.combine)

    def loop(self, stop: Optional[Callable[[int], bool]] = None) -> None:
        """Steps until config.steps more are done (or stop(step) is true), validating, logging, saving and
        sampling on their schedules."""
        config, trainer = self.config, self.trainer
        start, first, average = time.time(), trainer.steps, (0.0, 0.0)
        self.first = first
        while config.steps < 0 or trainer.steps - first < config.steps:
            if self.validation and _due(trainer.steps, config.val_every):
                with self.saved_on_failure():
                    held_out = validation_loss(self.model, self.validation)
                self.log(f'[{trainer.steps} | {time.time() - start:.2f}] validation loss = {held_out:.4f}')
            with self.saved_on_failure(Diverged):  # the model is the step before: kept
                loss = self.step()
            if _due(trainer.steps, config.print_every):  # gpt-2-simple's decayed mean of the printed losses
                average = (average[0] * 0.99 + loss, average[1] * 0.99 + 1.0)
                self.log(f'[{trainer.steps} | {time.time() - start:.2f}] loss={loss:.4f} '
                         f'avg={average[0] / average[1]:.4f}')
            if _due(trainer.steps, config.save_every):
                self.save()
            if _due(trainer.steps, config.sample_every):
                with self.saved_on_failure():
                    self.samples()
            if stop is not None and stop(trainer.steps):
                break

    @contextlib.contextmanager
    def saved_on_failure(self, kinds=Exception):
        """Between steps (validation, samples) or a step that changed nothing (Diverged): a failure of `kinds`
        saves the step reached before it is raised, so that the steps since the last save are kept (an update
        is whole: the step before it ended); before this run's first step there is nothing to keep."""
        try:
            yield
        except kinds:
            if self.trainer.steps == self.first:
                raise
            try:
                self.save()
            except Exception as e:  # the first failure is the one to report; this one is logged
                self.log(f'could not save step {self.trainer.steps} either: {first_line(e)}')
            raise

    def step(self) -> float:
        """One update on a fresh batch of batch_size * accumulate_gradients windows."""
        batch = self.sampler.sample(self.config.batch_size * self.config.accumulate_gradients)
        try:
            return self.trainer.step(batch)
        except PEER_ERRORS as e:  # what a collective whose peer has gone raises; another error is this host's own
            if not isinstance(self.strategy, tf.distribute.MultiWorkerMirroredStrategy):
                raise
            raise ClusterError(
                f'step {self.trainer.steps + 1}: the cluster stopped answering ({type(e).__name__}: '
                f'{first_line(e)[:200]}); rerun every worker with --restore_from latest '
                f'to resume from the chief\'s last checkpoint') from None

    def save(self) -> None:
        """The step reached into the run folder, once: a step already saved is not written again."""
        if not self.chief or self.saved == self.trainer.steps:
            return
        try:
            prefix = self.trainer.save(self.run_dir, max_checkpoints=self.config.max_checkpoints,
                                       vocabulary=self.vocabulary)
        except runfolder.Unfinished as e:
            raise OSError(e.errno, f'step {self.trainer.steps} is saved in {self.run_dir}, but writing {e.what} '
                                   f'failed ({e.strerror}); free the space, then resume with restore_from latest') \
                from None
        except OSError as e:
            current = runfolder.saved_step(self.run_dir)
            raise OSError(e.errno, f'cannot save step {self.trainer.steps} in {self.run_dir} ({e.strerror}); the '
                                   f'previous checkpoint ({current or "none"}) is intact') from None
        self.saved = self.trainer.steps
        self.log(f'Saving {prefix}')

    def samples(self) -> None:
        """sample_num samples as gpt-2-simple draws them: after one token of the training data, sample_length
        tokens with top_k 40 at temperature 1; printed and written to sample_dir/run_name/samples-<step>."""
        if not self.chief:
            return
        config, step = self.config, self.trainer.steps
        seed = None if config.seed is None else (config.seed, step)
        apart = np.random.default_rng(None if seed is None else [config.seed % 2 ** 64, step])  # not the windows'
        start = self.sampler.sample(1, rng=apart)[:, :1]  # int32 [1, 1]
        out = sample_sequence(self.model, min(config.sample_length, self.model.hparams.n_ctx),
                              context=np.repeat(start, config.sample_num, axis=0), top_k=40, seed=seed)
        texts = [f'======== SAMPLE {number} ========\n{self.encoder.decode(row)}\n'
                 for number, row in enumerate(out, start=1)]
        folder = os.path.join(config.sample_dir, config.run_name)
        os.makedirs(folder, exist_ok=True)
        checkpoint.replace_atomically(os.path.join(folder, f'samples-{step}'), '\n'.join(texts))
        for text in texts:
            self.log(text)


def run_vocabulary(model_dir) -> Optional[dict]:
    """What a run folder holds of its base model's vocabulary ({name there: source}): the original's files, an
    HF folder's under the original's names (the same formats), or its tokenizer.json; None: the bundled one."""
    from .encoder import vocabulary_files

    try:
        files = vocabulary_files(model_dir)
    except GPT2Error:  # half a pair: refused where text is read; a token file trains without it
        files = None
    if files:
        return dict(zip(('encoder.json', 'vocab.bpe'), files))
    tokenizer = os.path.join(model_dir, 'tokenizer.json')
    return {'tokenizer.json': tokenizer} if os.path.exists(tokenizer) else None


def finetune(model_dir: str, dataset, config: Optional[FinetuneConfig] = None, *,
             log: Callable[[str], None] = print, stop: Optional[Callable[[int], bool]] = None, strategy=None,
             **options) -> Trainer:
    """Fine-tunes the model in model_dir on dataset (a token file, OUT.bin of `gpt2-tf encode`, read in
    place; a path for load_dataset; or a list of token chunks); checkpoints go to checkpoint_dir/run_name.
    Returns the Trainer.

    The options are FinetuneConfig's fields (gpt-2-simple's, with its
    defaults): a config, keyword options that replace its values, or both.
    batch_size is the micro-batch: each update draws batch_size *
    accumulate_gradients windows of n_ctx tokens. steps=-1 trains until
    interrupted. restore_from='latest' resumes the run folder when it has a
    checkpoint (else starts from model_dir); 'fresh' starts from model_dir.
    Ctrl-C (or SIGTERM), or a log that can no longer be written (its reader
    gone: BrokenPipeError), saves the step reached (none before this run's first
    step), then raises Interrupted (a KeyboardInterrupt holding the trainer).
    stop, when given, is asked after each step whether to stop there.
    strategy: a make_strategy() strategy, or the name of one (as config.strategy).
    Data-parallel, every worker draws the same seeded global batch and its
    replicas take their slices; only the chief logs,
    samples and writes checkpoints (on several hosts, checkpoint_dir must be
    shared storage for restore_from='latest' to find them).
    """
    if isinstance(strategy, str):
        options['strategy'], strategy = strategy, None
    config = configure(config, **options)
    if strategy is None and config.strategy:
        strategy = make_strategy(config.strategy, timeout=config.collective_timeout)
    run = Run(model_dir, dataset, config, strategy=strategy, log=log)
    try:
        with terminated_as_interrupted():
            run.loop(stop)
    except (KeyboardInterrupt, BrokenPipeError) as e:
        closed = isinstance(e, BrokenPipeError)  # the log's reader has gone: the steps are kept all the same
        if closed:
            run.log = lambda line: None
        run.log('interrupted')
        saved = run.trainer.steps != run.first  # before this run's first step there is nothing new to keep
        if saved:
            run.save()
        raise Interrupted(run.trainer, saved, 'the log\'s output closed' if closed else 'interrupted') from None
    run.save()
    return run.trainer
