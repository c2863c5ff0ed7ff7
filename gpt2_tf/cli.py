"""The gpt2-tf command: a thin layer over the library.

    gpt2-tf generate "PROMPT"     conditional samples, like interactive_conditional_samples.py
    gpt2-tf generate              the interactive mode: prompts from stdin
    gpt2-tf sample                unconditional samples, like generate_unconditional_samples.py
    gpt2-tf inspect MODEL_DIR     parameter accounting, from hparams and from the checkpoint
    gpt2-tf compare MODEL_DIR     this port against the TF1 graph, block by block
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_MODEL = '124M'
BANNER = '=' * 40 + ' SAMPLE {} ' + '=' * 40


class CommandError(Exception):
    """An error to report in one line, without a traceback."""


def _add_model_arguments(parser):
    parser.add_argument('--model_name', '--model-name', default=None,
                        help=f'which model folder under models_dir (default {DEFAULT_MODEL})')
    parser.add_argument('--models_dir', '--models-dir', default='checkpoints',
                        help='the folder holding model folders (default: checkpoints)')
    parser.add_argument('--model_dir', '--model-dir', default=None,
                        help='a model folder to use directly, instead of models_dir/model_name')
    parser.add_argument('--device', default=None, help="pin a device, e.g. '/GPU:0' or '/CPU:0'")


def _add_sampling_arguments(parser, *, nsamples):
    parser.add_argument('--seed', type=int, default=None, help='fix to reproduce results')
    parser.add_argument('--nsamples', type=int, default=nsamples,
                        help=f'samples to print{" (0: until interrupted)" if nsamples == 0 else ""}'
                             f' (default {nsamples})')
    parser.add_argument('--batch_size', '--batch-size', type=int, default=1,
                        help='samples generated together (default 1); must divide nsamples')
    parser.add_argument('--length', type=int, default=None,
                        help='new tokens per sample (default: half the window after a prompt, '
                             'the whole window without one)')
    parser.add_argument('--temperature', type=float, default=1.0, help='0 is greedy (default 1)')
    parser.add_argument('--top_k', '--top-k', type=int, default=0, help='0: no truncation (default 0)')
    parser.add_argument('--top_p', '--top-p', type=float, default=1.0, help='nucleus sampling (default 1)')
    parser.add_argument('--mode', choices=['xla', 'function', 'eager'], default='xla',
                        help='how the decode loop runs (default xla)')
    parser.add_argument('--quiet', action='store_true', help='no progress bar on stderr')


def _model_dir(args) -> str:
    from .text import bundled_checkpoint

    if args.model_dir:
        return args.model_dir
    name = args.model_name or DEFAULT_MODEL
    path = os.path.join(os.path.expanduser(args.models_dir), name)
    if os.path.isdir(path):
        return path
    if args.model_name is None:
        print(f'gpt2-tf: no model at {path}, so using the bundled test checkpoint (random weights, '
              f'2 tiny layers: the text is gibberish). Get a real model with: '
              f'python download_model.py {DEFAULT_MODEL}', file=sys.stderr)
        return bundled_checkpoint()
    raise CommandError(f'no model at {path}; download it with: python download_model.py {name}')


def _load(args):
    from .checkpoint import load_model
    from .text import encoder_for

    model_dir = _model_dir(args)
    return load_model(model_dir, device=args.device), encoder_for(model_dir)


def _print_samples(texts, total, quiet):
    from tqdm import tqdm

    with tqdm(total=total or None, desc='samples', unit='sample', file=sys.stderr, leave=False,
              disable=quiet) as bar:
        for number, text in enumerate(texts, start=1):
            tqdm.write(BANNER.format(number), file=sys.stdout)
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()
            bar.update(1)


def _options(args, encoder):
    return dict(batch_size=args.batch_size, encoder=encoder, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, mode=args.mode)


def cmd_sample(args):
    from .text import iter_samples

    model, encoder = _load(args)
    texts = iter_samples(model, None, args.length, nsamples=args.nsamples or None, **_options(args, encoder))
    _print_samples(texts, args.nsamples, args.quiet)


def cmd_generate(args):
    from .text import default_length, iter_samples
    from .validate import check_length, room_for_prompt

    model, encoder = _load(args)
    length = args.length
    if length is None:
        length = default_length(model, conditional=True)
    check_length(length, model.hparams.n_ctx)
    if args.prompt is not None:
        texts = iter_samples(model, args.prompt, length, nsamples=args.nsamples, **_options(args, encoder))
        _print_samples(texts, args.nsamples, args.quiet)
        return
    room = room_for_prompt(length, model.hparams.n_ctx)
    while True:
        try:
            prompt = input('Model prompt >>> ')
        except EOFError:
            print()
            return
        count = len(encoder.encode(prompt))
        if count == 0:
            print('Prompt should not be empty!')
            continue
        if count > room:
            print(f'Number of tokens should be in range of 1 - {room}, got: {count}!')
            continue
        texts = iter_samples(model, prompt, length, nsamples=args.nsamples, **_options(args, encoder))
        _print_samples(texts, args.nsamples, args.quiet)
        print('=' * 80)


def cmd_inspect(args):
    import json

    from .diagnostics import format_table, parameter_table

    table = parameter_table(args.model_dir)
    print(json.dumps(table, indent=2) if args.json else format_table(table))
    if table['mismatches']:
        raise CommandError(f'{len(table["mismatches"])} component(s) disagree with hparams.json')


def cmd_compare(args):
    from .diagnostics import compare, format_comparison

    tokens = [int(t) for t in args.tokens.replace(',', ' ').split()]
    report = compare(args.model_dir, [tokens])
    print(format_comparison(report))
    if report['first_divergence'] is not None:
        sys.exit(1)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog='gpt2-tf', description='GPT-2 on TensorFlow 2, faithful to the original.')
    commands = main.add_subparsers(dest='command', required=True, metavar='COMMAND')

    generate = commands.add_parser('generate', help='samples after a prompt; without one, read prompts from stdin')
    generate.add_argument('prompt', nargs='?', default=None, help='the prompt text (omit for the interactive mode)')
    _add_model_arguments(generate)
    _add_sampling_arguments(generate, nsamples=1)
    generate.set_defaults(run=cmd_generate)

    sample = commands.add_parser('sample', help='unconditional samples')
    _add_model_arguments(sample)
    _add_sampling_arguments(sample, nsamples=0)
    sample.set_defaults(run=cmd_sample)

    inspect = commands.add_parser('inspect', help='parameter accounting of a model folder')
    inspect.add_argument('model_dir')
    inspect.add_argument('--json', action='store_true', help='machine-readable output')
    inspect.set_defaults(run=cmd_inspect)

    compare = commands.add_parser('compare', help='max |diff| per block and state against the TF1 graph')
    compare.add_argument('model_dir')
    compare.add_argument('--tokens', required=True, help='token ids, e.g. "464 2068 7586"')
    compare.set_defaults(run=cmd_compare)
    return main


def main(argv=None) -> int:
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except (CommandError, ValueError, FileNotFoundError) as e:
        print(f'gpt2-tf: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
