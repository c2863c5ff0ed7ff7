"""Fine-tuning, with gpt-2-simple's options (train_config.FinetuneConfig's fields), and encoding a dataset."""

from __future__ import annotations

from .. import train_config
from .common import add_model_arguments, add_verbose, model_folder, start_tensorflow


def cmd_finetune(args):
    """gpt-2-simple's finetune; Ctrl-C saves the step reached and exits 130."""
    config = train_config.from_arguments(args)  # every option checked, before TensorFlow
    folder = model_folder(args)
    folder.encoder()  # the vocabulary too
    start_tensorflow(args, folder)
    from ..train import finetune

    finetune(folder.path, args.dataset, config, log=lambda line: print(line, flush=True))


def cmd_encode(args):
    """A text dataset to an .npz of token chunks, as gpt-2-simple's encode_dataset (no TensorFlow)."""
    from ..dataset import encode_dataset
    from ..encoder import get_encoder

    count = encode_dataset(args.dataset, args.out, get_encoder(), args.combine)
    print(f'{args.out}: {count:,} tokens')


def add_commands(commands) -> None:
    finetune = commands.add_parser('finetune', help="fine-tune on a dataset, with gpt-2-simple's options")
    finetune.add_argument('dataset', help='a text file, a folder or glob of .txt files, or an .npz of tokens')
    add_model_arguments(finetune, device=False)
    train_config.add_arguments(finetune)
    add_verbose(finetune)
    finetune.set_defaults(run=cmd_finetune)

    encode = commands.add_parser('encode', help="a text dataset to an .npz of tokens (gpt-2-simple's encode_dataset)")
    encode.add_argument('dataset', help='a text file, a folder or glob of .txt files')
    encode.add_argument('out', help='the .npz to write')
    encode.add_argument('--combine', type=int, default=50000, help='characters of text per chunk (default: 50000)')
    encode.set_defaults(run=cmd_encode, verbose=False)
