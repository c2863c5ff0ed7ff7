"""Fine-tuning's options, written once: gpt-2-simple's names and defaults, with what each one does.

FinetuneConfig is the one source of the defaults: finetune() starts from it,
and the command line builds its flags from its fields (add_arguments) and
turns them back into a config (from_arguments), so the two cannot drift.
Every value is checked here, once, with a one-line GPT2Error. Nothing here
imports TensorFlow: the command line builds its parser before loading it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import typing
from typing import Optional

from .validate import DTYPES, INT64, GPT2Error, is_int, shown

OPTIMIZERS = ('adam', 'sgd', 'adafactor')
RESTORE_FROM = ('latest', 'fresh')
STRATEGIES = ('mirrored', 'multiworker')
LORA_TARGETS = ('c_attn', 'attn.c_proj', 'mlp.c_fc', 'mlp.c_proj')  # a block's conv1d products, as PEFT names them
VALIDATION = ('val_fraction', 'val_dataset', 'val_batch_size', 'val_batch_count')  # what val_every uses
COMBINE = 50000  # gpt-2-simple's characters of text per encoded chunk


def option(default, help: str, *, choices: tuple = (), aliases: tuple = ()):
    """A config field with its help text, and what the command line needs beyond the field's type."""
    return dataclasses.field(default=default, metadata={'help': help, 'choices': choices, 'aliases': aliases})


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    # where the run goes
    run_name: str = option('run1', 'the run folder under checkpoint_dir')
    checkpoint_dir: str = option('checkpoint', 'where run folders go')
    restore_from: str = option('latest', "'latest' resumes the run folder when it has a checkpoint, "
                                         "'fresh' starts again from the base model", choices=RESTORE_FROM)
    # how long, and each update
    steps: int = option(-1, 'updates to run (-1: until interrupted)')
    batch_size: int = option(1, 'windows of n_ctx tokens per micro-batch')
    accumulate_gradients: int = option(5, 'micro-batches per update: each update sees '
                                          'batch_size * accumulate_gradients windows')
    learning_rate: float = option(1e-4, "the optimizer's step size")
    optimizer: str = option('adam', "TF1's Adam (beta1 0.9, beta2 0.999, epsilon 1e-8), plain gradient descent, "
                                    'or Adafactor (factored second moments, no first moment: far less memory)',
                            choices=OPTIMIZERS)
    only_train_transformer_layers: bool = option(False, 'train the h* blocks only, not the embeddings or ln_f')
    recompute: bool = option(False, "recompute each block's activations in the backward pass (less memory)",
                             aliases=('--use_memory_saving_gradients',))
    # LoRA: train small adapters on the frozen base (gpt2_tf.lora), saved in PEFT's format
    lora_rank: int = option(0, 'LoRA rank: train adapters of this rank instead of the weights (0: off)')
    lora_alpha: Optional[float] = option(None, "LoRA's alpha: the update is x·A·B·alpha/rank (none: 2 x rank)")
    lora_targets: str = option('c_attn', 'the products that get adapters, comma-separated: c_attn, attn.c_proj, '
                                         'mlp.c_fc, mlp.c_proj')
    lora_dropout: float = option(0.0, "dropout on the adapters' input while training")
    dtype: str = option('float32', "the frozen base weights' precision under LoRA (full fine-tuning trains "
                                   'float32 weights; see gpt2_tf.precision)', choices=DTYPES)
    # the data
    combine: int = option(COMBINE, 'characters of text per encoded chunk; training windows never cross chunks '
                                 '(a token file has none: windows start anywhere)')
    seed: Optional[int] = option(None, 'fix to reproduce the windows and samples')
    # what the loop prints and writes
    print_every: int = option(1, 'steps between loss lines (0: never)')
    save_every: int = option(1000, 'steps between checkpoints (0: only when the run ends, as it always does)')
    max_checkpoints: int = option(1, 'checkpoints kept in the run folder (a LoRA run keeps its latest adapter)')
    sample_every: int = option(100, 'steps between samples (0: never)')
    sample_length: int = option(1023, 'tokens per sample (at most n_ctx)')
    sample_num: int = option(1, 'samples each time')
    sample_dir: str = option('samples', 'where samples go, in a folder named after the run')
    # the validation loss, on fixed batches of a second dataset
    val_dataset: Optional[str] = option(None, 'a token file (.bin), text file, folder, glob or .npz for the '
                                              'validation loss')
    val_fraction: float = option(0.0, "hold out a token file's last documents, about this fraction of its "
                                      'tokens, for the validation loss (0: none)')
    val_every: int = option(0, 'steps between validation losses (0: never)')
    val_batch_size: int = option(2, 'windows per validation batch')
    val_batch_count: int = option(40, 'validation batches, drawn once')
    # several devices or hosts
    strategy: Optional[str] = option(None, "data-parallel: this host's devices, or the hosts in TF_CONFIG",
                                     choices=STRATEGIES)
    collective_timeout: float = option(300.0, 'seconds before a silent worker stops the run')

    def __post_init__(self):
        check(self)


def configure(config: Optional[FinetuneConfig] = None, **options) -> FinetuneConfig:
    """config (FinetuneConfig() when None) with some values replaced, checked again."""
    names = [f.name for f in dataclasses.fields(FinetuneConfig)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise GPT2Error(f'no fine-tuning option {unknown[0]!r}; the options are FinetuneConfig\'s fields: '
                        f'{", ".join(names)}')
    return dataclasses.replace(config if config is not None else FinetuneConfig(), **options)


# --- the checks, one place for the library and the command line ------------------------------------

_shown = shown  # validate's: a value as a user typed it


def check_integer(name: str, value, low: int, what: str = '') -> None:
    if not is_int(value) or value < low:
        raise GPT2Error(f'{name} must be an integer >= {low}{what}, got {_shown(value)}')


def check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise GPT2Error(f'{name} must be a finite number > 0, got {_shown(value)}')


MAX_TIMEOUT = 1e6  # seconds (11.6 days): beyond it, the watchdog's wait overflows the platform's time


def check_timeout(seconds) -> None:
    check_positive('collective_timeout', seconds)
    if seconds > MAX_TIMEOUT:
        raise GPT2Error(f'collective_timeout must be at most {MAX_TIMEOUT:.0f} seconds, got {_shown(seconds)}')


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise GPT2Error(f'{name} must be one of {choices}, got {_shown(value)}')


def check_optimizer(learning_rate, optimizer, accumulate_gradients) -> None:
    """The Trainer's own options (the Trainer checks them too, when built without a config)."""
    check_choice('optimizer', optimizer, OPTIMIZERS)
    check_positive('learning_rate', learning_rate)
    check_integer('accumulate_gradients', accumulate_gradients, 1)


def check(config: FinetuneConfig) -> None:
    """Raises GPT2Error, naming the option, for the first value finetune cannot use."""
    check_optimizer(config.learning_rate, config.optimizer, config.accumulate_gradients)
    for name in ('batch_size', 'max_checkpoints', 'sample_num', 'sample_length', 'val_batch_size',
                 'val_batch_count', 'combine'):
        check_integer(name, getattr(config, name), 1)
    for name in ('print_every', 'save_every', 'sample_every', 'val_every'):
        check_integer(name, getattr(config, name), 0, ' (0: never)')
    check_integer('steps', config.steps, -1, ' (-1: until interrupted)')
    check_validation(config)
    check_lora(config)
    check_choice('restore_from', config.restore_from, RESTORE_FROM)
    check_choice('strategy', config.strategy, (None,) + STRATEGIES)
    check_timeout(config.collective_timeout)
    for name in ('run_name', 'checkpoint_dir', 'sample_dir'):
        if not isinstance(getattr(config, name), str) or not getattr(config, name):
            raise GPT2Error(f'{name} must be a non-empty string, got {_shown(getattr(config, name))}')
    if config.seed is not None:  # the samples' seed is the pair (seed, step), each within int64
        check_integer('seed', config.seed, 0, ' (or None)')
        if config.seed > INT64.max:
            raise GPT2Error(f'seed {config.seed} is out of range: use an integer in [0, {INT64.max}]')
    if not isinstance(config.only_train_transformer_layers, bool) or not isinstance(config.recompute, bool):
        raise GPT2Error('only_train_transformer_layers and recompute must be True or False')


def check_targets(targets) -> tuple:
    """'c_attn,mlp.c_fc' or a sequence -> a tuple of LORA_TARGETS entries, in LORA_TARGETS' order whatever the
    order given (each adapter's initial draw and dropout masks follow it: a run resumed with its targets listed
    otherwise draws as it did); anything else is refused by name."""
    items = [t.strip() for t in targets.split(',')] if isinstance(targets, str) else list(targets)
    for t in items:
        if t not in LORA_TARGETS and t != 'attn.c_attn':
            raise GPT2Error(f'lora_targets: no module {t!r}; choose from {", ".join(LORA_TARGETS)} (comma-separated)')
    if not items:
        raise GPT2Error(f'lora_targets is empty; choose from {", ".join(LORA_TARGETS)}')
    chosen = {'c_attn' if t == 'attn.c_attn' else t for t in items}
    return tuple(t for t in LORA_TARGETS if t in chosen)


def check_lora_options(rank, alpha, targets, dropout) -> None:
    """LoRA's options, for FinetuneConfig and for lora.attach (a Trainer built without a config)."""
    check_integer('lora_rank', rank, 0, ' (0: off)')
    if alpha is not None:
        check_positive('lora_alpha', alpha)
    check_targets(targets)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise GPT2Error(f'lora_dropout must be in [0, 1), got {_shown(dropout)}')


def check_lora(config: FinetuneConfig) -> None:
    check_lora_options(config.lora_rank, config.lora_alpha, config.lora_targets, config.lora_dropout)
    check_choice('dtype', config.dtype, DTYPES)
    if not config.lora_rank:
        same = {'lora_targets': lambda a, b: check_targets(a) == check_targets(b)}
        given = [f.name for f in dataclasses.fields(config) if f.name in ('lora_alpha', 'lora_targets', 'lora_dropout')
                 and not same.get(f.name, operator.eq)(getattr(config, f.name), f.default)]
        if given:
            raise GPT2Error(f'{", ".join(given)} shape{"s" if len(given) == 1 else ""} LoRA adapters, which '
                            f'lora_rank 0 leaves off: set lora_rank too (8, say), or leave {"it" if len(given) == 1 else "them"} '
                            f'out for full fine-tuning')
    if config.dtype != 'float32' and not config.lora_rank:
        raise GPT2Error(f'dtype {config.dtype} holds frozen weights, and only LoRA adapters train over them: '
                        f'set lora_rank too, or keep dtype float32 for full fine-tuning')


def check_validation(config: FinetuneConfig) -> None:
    fraction = config.val_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise GPT2Error(f'val_fraction must be in [0, 1), got {_shown(fraction)}')
    if fraction and config.val_dataset is not None:
        raise GPT2Error('give val_fraction or val_dataset, not both: each names the validation data')
    if not config.val_every:
        given = [f.name for f in dataclasses.fields(config) if f.name in VALIDATION
                 and getattr(config, f.name) != f.default]
        if given:
            raise GPT2Error(f'{", ".join(given)} shape{"s" if len(given) == 1 else ""} a validation loss that '
                            f'val_every=0 never computes: set val_every too (100, say)')
    if config.val_every and not fraction and config.val_dataset is None:
        raise GPT2Error('val_every computes a validation loss on data that neither val_dataset nor val_fraction '
                        'gives: set one of them')


# --- the command line's flags, from the fields ------------------------------------------------------

def _shown_default(value) -> str:
    if isinstance(value, bool):
        return 'on' if value else 'off'
    if value is None:
        return 'none'
    return f'{value:g}' if isinstance(value, float) else str(value)


def _kind(field: dataclasses.Field) -> type:
    """The field's type for argparse: Optional[int] -> int."""
    hint = typing.get_type_hints(FinetuneConfig)[field.name]
    arguments = [a for a in typing.get_args(hint) if a is not type(None)]
    return arguments[0] if arguments else hint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, --<name>, whose help ends with the field's default, e.g. '(default: 0.0001)'."""
    for field in dataclasses.fields(FinetuneConfig):
        meta, kind = field.metadata, _kind(field)
        text = f'{meta["help"]} (default: {_shown_default(field.default)})'
        flags = [f'--{field.name}', *meta['aliases']]
        if kind is bool:
            parser.add_argument(*flags, dest=field.name, action='store_true', default=field.default, help=text)
        else:
            parser.add_argument(*flags, dest=field.name, type=kind, default=field.default, help=text,
                                choices=list(meta['choices']) or None)


def from_arguments(args: argparse.Namespace) -> FinetuneConfig:
    """The config from a namespace that add_arguments' flags filled (other attributes are ignored)."""
    return FinetuneConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FinetuneConfig)})
