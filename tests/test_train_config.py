"""FinetuneConfig: gpt-2-simple's defaults written once, the command line's flags built from them, one check."""

import argparse
import dataclasses

import numpy as np
import pytest

from gpt2_tf.train_config import FinetuneConfig, add_arguments, configure, from_arguments
from gpt2_tf.validate import GPT2Error

# gpt-2-simple's finetune() signature (minimaxir/gpt-2-simple, gpt_2.py), typed here by hand.
GPT2_SIMPLE = dict(steps=-1, run_name='run1', checkpoint_dir='checkpoint', combine=50000, batch_size=1,
                   learning_rate=0.0001, accumulate_gradients=5, restore_from='latest', sample_every=100,
                   sample_length=1023, sample_num=1, save_every=1000, print_every=1, max_checkpoints=1,
                   only_train_transformer_layers=False, optimizer='adam', val_dataset=None, val_batch_size=2,
                   val_batch_count=40, val_every=0)

# Every flag `gpt2-tf finetune` had before its flags came from the fields: scripts keep working.
FLAGS = ['--run_name', '--checkpoint_dir', '--steps', '--learning_rate', '--batch_size', '--accumulate_gradients',
         '--sample_every', '--sample_length', '--sample_num', '--save_every', '--print_every', '--max_checkpoints',
         '--optimizer', '--val_dataset', '--val_every', '--val_batch_size', '--val_batch_count', '--combine',
         '--seed', '--restore_from', '--strategy', '--collective_timeout', '--only_train_transformer_layers',
         '--recompute', '--use_memory_saving_gradients']


def parser():
    built = argparse.ArgumentParser(prog='finetune')
    add_arguments(built)
    return built


def test_the_defaults_are_gpt2_simples():
    config = FinetuneConfig()
    assert {name: getattr(config, name) for name in GPT2_SIMPLE} == GPT2_SIMPLE
    assert configure() == config  # what finetune() starts from without a config


def test_a_parser_built_from_the_fields_gives_the_default_config():
    assert from_arguments(parser().parse_args([])) == FinetuneConfig()


def test_the_flags_keep_their_names_and_types():
    options = {flag for action in parser()._actions for flag in action.option_strings}
    assert set(FLAGS) <= options
    args = parser().parse_args(['--learning_rate', '3e-3', '--steps', '5', '--seed', '2', '--optimizer', 'sgd',
                                '--use_memory_saving_gradients', '--only_train_transformer_layers',
                                '--strategy', 'mirrored', '--collective_timeout', '20'])
    assert from_arguments(args) == FinetuneConfig(learning_rate=3e-3, steps=5, seed=2, optimizer='sgd',
                                                  recompute=True, only_train_transformer_layers=True,
                                                  strategy='mirrored', collective_timeout=20.0)
    with pytest.raises(SystemExit):
        parser().parse_args(['--optimizer', 'rmsprop'])  # argparse's choices, from the config's own tuple


def test_every_flags_help_ends_with_its_default():
    shown = {'run_name': 'run1', 'checkpoint_dir': 'checkpoint', 'restore_from': 'latest', 'steps': '-1',
             'batch_size': '1', 'accumulate_gradients': '5', 'learning_rate': '0.0001', 'optimizer': 'adam',
             'only_train_transformer_layers': 'off', 'recompute': 'off', 'combine': '50000', 'seed': 'none',
             'print_every': '1', 'save_every': '1000', 'max_checkpoints': '1', 'sample_every': '100',
             'sample_length': '1023', 'sample_num': '1', 'sample_dir': 'samples', 'val_dataset': 'none',
             'val_every': '0', 'val_fraction': '0', 'val_batch_size': '2', 'val_batch_count': '40', 'strategy': 'none',
             'collective_timeout': '300', 'lora_rank': '0', 'lora_alpha': 'none', 'lora_targets': 'c_attn',
             'lora_dropout': '0', 'dtype': 'float32'}
    helps = {action.dest: action.help for action in parser()._actions if action.dest != 'help'}
    assert set(helps) == {f.name for f in dataclasses.fields(FinetuneConfig)} == set(shown)
    for name, default in shown.items():
        assert helps[name].endswith(f'(default: {default})'), (name, helps[name])
        assert len(helps[name]) > len(f' (default: {default})') + 10, name  # and says what the option does


@pytest.mark.parametrize('values, message', [
    (dict(batch_size=0), 'batch_size must be an integer >= 1, got 0'),
    (dict(accumulate_gradients=2.5), 'accumulate_gradients must be an integer >= 1, got 2.5'),
    (dict(learning_rate=np.float64(0.0)), 'learning_rate must be a finite number > 0, got 0.0'),  # not np.float64(0.0)
    (dict(learning_rate=float('inf')), 'learning_rate must be a finite number > 0, got inf'),
    (dict(optimizer='rmsprop'), "optimizer must be one of \\('adam', 'sgd', 'adafactor'\\), got 'rmsprop'"),
    (dict(print_every=-1), r'print_every must be an integer >= 0 \(0: never\), got -1'),
    (dict(steps=-2), r'steps must be an integer >= -1 \(-1: until interrupted\), got -2'),
    (dict(restore_from='newest'), "restore_from must be one of \\('latest', 'fresh'\\)"),
    (dict(strategy='tpu'), "strategy must be one of \\(None, 'mirrored', 'multiworker'\\)"),
    (dict(collective_timeout=0), 'collective_timeout must be a finite number > 0'),
    (dict(collective_timeout=1e300), 'collective_timeout must be at most 1000000 seconds, got 1e[+]300'),
    (dict(seed=-1), 'seed must be an integer >= 0'),
    (dict(seed=2**63), r'seed 9223372036854775808 is out of range: use an integer in \[0, 9223372036854775807\]'),
    (dict(run_name=''), "run_name must be a non-empty string, got ''"),
    (dict(val_fraction=1.0, val_every=1), r'val_fraction must be in \[0, 1\), got 1.0'),
    (dict(val_fraction=0.1, val_every=1, val_dataset='v.bin'), 'give val_fraction or val_dataset, not both'),
    (dict(val_fraction=0.1), '^val_fraction shapes a validation loss that val_every=0 never computes: set val_every'),
    (dict(val_dataset='v.txt', val_batch_count=7), '^val_dataset, val_batch_count shape a validation loss that '
                                                    'val_every=0 never computes'),  # they were passed over
    (dict(val_every=5), 'val_every computes a validation loss on data that neither val_dataset nor val_fraction '),
    (dict(lora_alpha=16.0), r'lora_alpha shapes LoRA adapters, which lora_rank 0 leaves off: set lora_rank too '
                            r'\(8, say\), or leave it out'),
    (dict(lora_targets='c_attn,mlp.c_fc', lora_dropout=0.1), 'lora_targets, lora_dropout shape LoRA adapters, which '
                                                             'lora_rank 0 leaves off: .*leave them out'),
])
def test_bad_values_are_one_line_errors(values, message):
    with pytest.raises(GPT2Error, match=message) as error:
        FinetuneConfig(**values)
    assert '\n' not in str(error.value)
    with pytest.raises(GPT2Error, match=message):  # replacing a value checks it again
        configure(FinetuneConfig(), **values)


def test_an_unknown_option_is_named():
    with pytest.raises(GPT2Error, match="no fine-tuning option 'learning_rte'"):
        configure(learning_rte=1e-3)


def test_a_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FinetuneConfig().steps = 3


def test_the_finetune_command_takes_its_flags_and_defaults_from_the_config():
    from gpt2_tf.cli import parser as command_line

    args = command_line().parse_args(['finetune', 'corpus.txt'])
    assert from_arguments(args) == FinetuneConfig()
    args = command_line().parse_args(['finetune', 'corpus.txt', '--use_memory_saving_gradients', '--steps', '7'])
    assert from_arguments(args) == FinetuneConfig(recompute=True, steps=7)
