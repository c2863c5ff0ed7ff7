"""Fine-tuning, with gpt-2-simple's options (train_config.FinetuneConfig's fields), and encoding text for it."""

from __future__ import annotations

from .. import train_config
from .common import CommandError, add_model_arguments, add_verbose, model_folder, start_tensorflow


def cmd_finetune(args):
    """gpt-2-simple's finetune; Ctrl-C saves the step reached and exits 130."""
    config = train_config.from_arguments(args)  # every option checked, before TensorFlow
    folder = model_folder(args)
    folder.encoder()  # the vocabulary too
    start_tensorflow(args, folder)
    from ..train import finetune

    finetune(folder.path, args.dataset, config, log=lambda line: print(line, flush=True))


def cmd_encode(args):
    """Text to a token file (.bin, read in place by finetune) or to gpt-2-simple's .npz of chunks; no TensorFlow."""
    from ..encoder import get_encoder

    if args.out.endswith('.bin'):
        from ..corpus import encode_corpus, terminal_progress

        progress, close = terminal_progress(args.inputs, glob=args.glob)
        try:
            info = encode_corpus(args.inputs, args.out, glob=args.glob, processes=args.processes, progress=progress)
        finally:
            close()
        print(f'{args.out}: {info["tokens"]:,} tokens, {info["documents"]:,} documents')
    elif args.out.endswith('.npz'):
        from ..dataset import encode_dataset

        if len(args.inputs) != 1:
            raise CommandError(f'an .npz is encoded from one dataset (a file, folder or glob), got {len(args.inputs)}; '
                               f'write a .bin to encode several')
        count = encode_dataset(args.inputs[0], args.out, get_encoder(), args.combine)
        print(f'{args.out}: {count:,} tokens')
    else:
        raise CommandError(f'{args.out}: the output must end in .bin (a token file) or .npz (gpt-2-simple\'s '
                           f'chunks)')


def add_commands(commands) -> None:
    finetune = commands.add_parser('finetune', help="fine-tune on a dataset, with gpt-2-simple's options")
    finetune.add_argument('dataset', help='a token file (.bin, gpt2-tf encode), a text file, a folder or glob of '
                                          '.txt files, or an .npz of tokens')
    add_model_arguments(finetune, device=False)
    train_config.add_arguments(finetune)
    add_verbose(finetune)
    finetune.set_defaults(run=cmd_finetune)

    encode = commands.add_parser('encode', help='text to a token file (.bin) or to gpt-2-simple\'s .npz of chunks')
    encode.add_argument('inputs', nargs='+', metavar='INPUT',
                        help='text files, folders (their files matching --glob, in sorted path order), or - for stdin')
    encode.add_argument('out', metavar='OUT', help='the .bin (a token file) or .npz to write')
    encode.add_argument('--glob', default='*.txt', help="the files of a folder to encode (default: '*.txt')")
    encode.add_argument('--processes', type=int, default=1,
                        help='processes encoding a .bin in parallel, in order (default: 1)')
    encode.add_argument('--combine', type=int, default=50000,
                        help='for an .npz: characters of text per chunk (default: 50000)')
    encode.set_defaults(run=cmd_encode, verbose=False)
