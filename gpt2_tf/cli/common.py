"""What every command shares: the one-line error, the model from its arguments, and the parser's pieces.

A command checks every argument first (the model folder, its hparams and
vocabulary, the options) without TensorFlow, which takes seconds to load;
open_model() then loads TensorFlow quietly and the model, last.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from .. import quiet
from ..loading import BUNDLED, DEFAULT_MODEL, DEFAULT_MODELS_DIR, ModelFolder, resolve
from ..validate import DTYPES, GPT2Error

BANNER = '=' * 40 + ' SAMPLE {} ' + '=' * 40
# compiled.MODES, which imports TensorFlow; tests/test_cli.py holds them equal.
MODES = ('xla', 'function', 'eager')


class CommandError(GPT2Error):
    """An error to report in one line, without a traceback."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose unknown flags are reported with this (sub)command's usage and the closest flag."""

    def unknown(self, extras: list) -> None:
        flags = [s for action in self._actions for s in action.option_strings]
        hints = []
        for extra in extras:
            close = difflib.get_close_matches(extra.split('=', 1)[0], flags, n=1, cutoff=0.6)
            hints.append(f'{extra} (did you mean {close[0]}?)' if close and extra.startswith('-') else extra)
        self.error('unrecognized arguments: ' + ' '.join(hints))


def one_line(message: str, category, *_args, **_kwargs) -> str:
    """warnings.formatwarning for the command line: 'gpt2-tf: warning: MESSAGE', no source line."""
    return f'gpt2-tf: warning: {str(message).strip().splitlines()[0]}\n'


# --- the model ---------------------------------------------------------------------------------

def model_folder(args) -> ModelFolder:
    """The model that --model_dir (or a MODEL_DIR argument), --model_name and --models_dir name, and the --adapter
    folder checked, before TensorFlow loads."""
    name, models = getattr(args, 'model_name', None), getattr(args, 'models_dir', None)
    if args.model_dir is not None and (name is not None or models is not None):
        given = '--model_name' if name is not None else '--models_dir'
        raise CommandError(f'--model_dir names the model folder itself: give it or {given}, not both')
    adapter = getattr(args, 'adapter', None)
    if adapter is not None and not os.path.isfile(os.path.join(adapter, 'adapter_config.json')):
        raise CommandError(f'--adapter {adapter}: no adapter_config.json there; give a LoRA run folder '
                           f'(finetune --lora_rank) or a PEFT LoRA folder')
    return resolve(args.model_dir, model_name=name, models_dir=models)


def start_tensorflow(args, folder: ModelFolder = None, *, onednn: bool = True) -> None:
    """GPT2_TF_KERNELS checked (here, for every command alike: the kernels read it only where a command reaches
    them), the fallback notice, if any, then TensorFlow without its start-up lines (--verbose shows them)."""
    quiet.check_switch(quiet.KERNELS_ENV)
    if folder is not None and folder.notice:
        print(folder.notice, file=sys.stderr)
    quiet.tensorflow(verbose=args.verbose, onednn=onednn)


def open_model(args, folder: ModelFolder, *, device: str = None, decodes: bool = False):
    """TensorFlow and the model, once every argument has been checked: --device and --dtype from args.

    TensorFlow's oneDNN ops are on (gpt2_tf.quiet.prefer_onednn), but decodes: the command only samples
    (generate, sample). With --dtype int8 it then runs without them: the products are the int8 kernel's
    either way, and oneDNN's allocator keeps each freed float32 read for reuse (a 1558M-shaped generate
    peaked at 2.90 GiB with it, 2.45 without). Measured (bench_int8 --sections onednn): greedy at batch 1
    0.91x the time, at batch 8 1.11x. Scoring and serving keep them: their int8 forward pass took
    1.17-1.30x without. TF_ENABLE_ONEDNN_OPTS, when set, wins.
    """
    start_tensorflow(args, folder, onednn=not (decodes and getattr(args, 'dtype', None) == 'int8'))
    device = getattr(args, 'device', None) or device
    try:
        quiet.check_device(getattr(args, 'device', None))
    except ValueError as e:
        raise CommandError(str(e)) from None
    from ..loading import load_model

    return load_model(folder, device=device, dtype=getattr(args, 'dtype', 'float32'),
                      adapter=getattr(args, 'adapter', None), strict=not getattr(args, 'no_strict', False))


# --- the parser's pieces -----------------------------------------------------------------------

def add_model_arguments(parser, *, device: bool = True) -> None:
    parser.add_argument('--model_name', '--model-name', default=None,
                        help=f'a model folder under models_dir: {DEFAULT_MODEL}, 355M, ..., or {BUNDLED} for the '
                             f'bundled test checkpoint (default: {DEFAULT_MODEL}, else {BUNDLED} until it is '
                             f'downloaded)')
    parser.add_argument('--models_dir', '--models-dir', default=None,
                        help=f'the folder holding model folders (default: {DEFAULT_MODELS_DIR})')
    parser.add_argument('--model_dir', '--model-dir', default=None,
                        help='a model folder to use directly: the original layout, a fine-tuning run folder or a '
                             'Hugging Face folder (default: none, models_dir/model_name)')
    if device:  # finetune (device=False) trains its own adapter, with --lora_rank
        parser.add_argument('--device', default=None,
                            help="pin a device, e.g. '/GPU:0' or '/CPU:0' (default: TensorFlow's choice)")
        add_adapter(parser)
        add_strict(parser)


def add_model_folder(parser, *, loads: bool = True) -> None:
    """MODEL_DIR; with --adapter and --no_strict where the command loads the model (loads=False: it reads only
    shapes, or the TF1 graph reads the folder)."""
    parser.add_argument('model_dir', metavar='MODEL_DIR',
                        help=f'a model folder (original, run or Hugging Face), or a name: {DEFAULT_MODEL} '
                             f'(under {DEFAULT_MODELS_DIR}/) or {BUNDLED} (the bundled test checkpoint)')
    if loads:
        add_adapter(parser)
        add_strict(parser)


def add_adapter(parser) -> None:
    parser.add_argument('--adapter', metavar='RUN', default=None,
                        help='a LoRA adapter folder (a run folder of finetune --lora_rank, or PEFT\'s) to merge into '
                             'the model (default: none)')


def add_strict(parser) -> None:
    parser.add_argument('--no_strict', '--no-strict', action='store_true',
                        help="load a checkpoint that also holds variables the model does not have (optimizer "
                             "slots), ignoring them (default: off, such a checkpoint is refused)")


def add_dtype(parser) -> None:
    parser.add_argument('--dtype', choices=DTYPES, default='float32',
                        help="the weights' precision (default: float32, exact; see the README for speed and "
                             "fidelity)")


def add_mode(parser) -> None:
    parser.add_argument('--mode', choices=MODES, default=None,
                        help='how the decode loop runs (default: xla for float32 weights, function for reduced)')


def add_verbose(parser) -> None:
    parser.add_argument('--verbose', action='store_true',
                        help="show TensorFlow's start-up messages, and a TensorFlow error's traceback "
                             "(default: off)")


def add_quiet(parser) -> None:
    parser.add_argument('--quiet', action='store_true', help='no progress bar on stderr (default: off)')
