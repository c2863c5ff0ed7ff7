"""Fine-tuning, with gpt-2-simple's options (train_config.FinetuneConfig's fields), and encoding text for it."""

from __future__ import annotations

import signal
import threading

from .. import train_config
from .common import add_model_arguments, add_verbose, model_folder, start_tensorflow


def cmd_finetune(args):
    """gpt-2-simple's finetune; Ctrl-C saves the step reached and exits 130."""
    from ..dataset import needs_vocabulary

    config = train_config.from_arguments(args)  # every option checked, before TensorFlow
    folder = model_folder(args)
    if needs_vocabulary(args.dataset, config):
        folder.encoder()  # the vocabulary's refusals too, before TensorFlow
    start_tensorflow(args, folder)
    from ..train import finetune

    finetune(folder, args.dataset, config, log=lambda line: print(line, flush=True))


def cmd_encode(args):
    """Text to a token file (.bin, read in place by finetune) or to gpt-2-simple's .npz of chunks; no TensorFlow."""
    from ..dataset import encode

    main = threading.current_thread() is threading.main_thread()  # only its handlers can be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None  # a scheduler's stop: as Ctrl-C
    try:
        info = encode(args.inputs, args.out, glob=args.glob, processes=args.processes, combine=args.combine,
                      progress=True, model_dir=args.model_dir)
    finally:
        if main:  # None: a handler not set from Python, which the default stands for
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    documents = '' if info['documents'] is None else f', {info["documents"]:,} documents'
    print(f'{args.out}: {info["tokens"]:,} tokens{documents}')


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def add_commands(commands) -> None:
    finetune = commands.add_parser('finetune', help="fine-tune on a dataset, with gpt-2-simple's options")
    finetune.add_argument('dataset', help='a token file (.bin, gpt2-tf encode), a text file, a folder (every file in '
                                          'it not hidden, as gpt-2-simple reads one) or a glob of files, or an .npz '
                                          'of tokens')
    add_model_arguments(finetune, device=False)
    train_config.add_arguments(finetune)
    add_verbose(finetune)
    finetune.set_defaults(run=cmd_finetune)

    encode = commands.add_parser('encode', help='text to a token file (.bin) or to gpt-2-simple\'s .npz of chunks')
    encode.add_argument('inputs', nargs='+', metavar='INPUT',
                        help='text files, folders (their files matching --glob, in sorted path order), or - for stdin')
    encode.add_argument('out', metavar='OUT', help='the .bin (a token file) or .npz to write')
    encode.add_argument('--glob', default=None, help="the files of a folder to encode (default: '*.txt' for a .bin, "
                                                     "every file for an .npz, as finetune reads a folder)")
    encode.add_argument('--model_dir', '--model-dir', default=None,
                        help="encode with this model folder's vocabulary (default: the bundled GPT-2 one)")
    encode.add_argument('--processes', type=int, default=None,
                        help="processes encoding a .bin in parallel, in order (default: the CPUs this process "
                             "may use, within a container's CPU quota)")
    encode.add_argument('--combine', type=int, default=None,
                        help='for an .npz: characters of text per chunk (default: 50000)')
    encode.set_defaults(run=cmd_encode, verbose=False)
