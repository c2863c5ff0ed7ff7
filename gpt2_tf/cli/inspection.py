"""Looking inside: inspect (parameter accounting), explore (an HTML page of the block), compare (against TF1)."""

from __future__ import annotations

import json
import os
import sys

from .common import (CommandError, add_dtype, add_model_folder, add_strict, add_verbose, model_folder, open_model,
                     start_tensorflow)


def cmd_inspect(args):
    folder = model_folder(args)
    folder.hparams()
    start_tensorflow(args, folder)
    from ..diagnostics import format_table, parameter_table

    table = parameter_table(folder)
    print(json.dumps(table, indent=2) if args.json else format_table(table))
    if table['mismatches']:
        settings = 'config.json' if folder.layout == 'hf' else 'hparams.json'
        raise CommandError(f'{len(table["mismatches"])} problem(s) against {settings}, the first: '
                           f'{table["mismatches"][0]}')


def cmd_explore(args):
    """One self-contained HTML page of the block, for a checkpoint and a prompt."""
    folder = model_folder(args)
    hparams, encoder = folder.hparams(), folder.encoder()
    from ..validate import check_explorer_prompt, check_token_ids, check_utf8

    check_utf8(args.prompt, name='--prompt')
    tokens = encoder.encode(args.prompt)
    check_explorer_prompt(len(tokens), hparams.n_layer, hparams.n_head, hparams.n_ctx, name='--prompt')
    check_token_ids(tokens, hparams.n_vocab, name="the prompt's token", encoded=True)
    if not args.output or os.path.isdir(args.output) or os.path.basename(args.output) in ('', '.', '..'):
        raise CommandError(f'-o {args.output!r} is not a file name: give the page\'s path, e.g. '
                           f'{os.path.join(args.output, "report.html") if args.output else "report.html"}')
    out = os.path.abspath(args.output)
    if not os.path.isdir(os.path.dirname(out)) or not os.access(os.path.dirname(out), os.W_OK):
        raise CommandError(f'cannot write {args.output}: {os.path.dirname(out)} is not a writable folder')
    model = open_model(args, folder)
    from ..explorer import write_report

    write_report(model, encoder, args.prompt, out, model_dir=folder.checkpoint or folder.path)
    print(f'{args.output}: written ({len(tokens)} tokens, {hparams.n_layer} blocks)')


def cmd_compare(args):
    from ..validate import check_sequence, check_token_ids

    folder = model_folder(args)
    try:
        tokens = [int(t) for t in args.tokens.replace(',', ' ').split()]
    except ValueError:
        raise CommandError(f'--tokens takes token ids separated by spaces, e.g. "464 2068"; got {args.tokens!r}') \
            from None
    if not tokens:
        raise CommandError('--tokens is empty: give at least one token id, e.g. "464 2068"')
    folder.original()  # before TensorFlow starts
    hparams = folder.hparams()
    check_token_ids(tokens, hparams.n_vocab)
    check_sequence(0, len(tokens), hparams.n_ctx)
    start_tensorflow(args, folder)
    from ..diagnostics import compare, format_comparison

    report = compare(folder, [tokens], strict=not args.no_strict)
    print(format_comparison(report))
    if report['first_divergence'] is not None:
        sys.exit(1)


def add_commands(commands) -> None:
    explore = commands.add_parser('explore', help='an HTML page of the block: attention, the logit lens, ...')
    add_model_folder(explore)
    explore.add_argument('--prompt', required=True, help='the text to look at (required: no default)')
    explore.add_argument('-o', '--output', default='report.html', help='the HTML file (default: report.html)')
    add_dtype(explore)
    add_verbose(explore)
    explore.set_defaults(run=cmd_explore)


def add_inspect_and_compare(commands) -> None:
    inspect = commands.add_parser('inspect', help='parameter accounting of a model folder')
    add_model_folder(inspect, loads=False)
    inspect.add_argument('--json', action='store_true', help='machine-readable output (default: off, a table)')
    add_verbose(inspect)
    inspect.set_defaults(run=cmd_inspect)

    compare = commands.add_parser('compare', help='max |diff| per block and state against the TF1 graph',
                                  description='max |diff| per block and state against the TF1 graph; exits 1 when a '
                                              'state is past tolerance')
    add_model_folder(compare, loads=False)
    add_strict(compare)  # the port loads the checkpoint; the TF1 graph reads only its own variables
    compare.add_argument('--tokens', required=True,
                         help='token ids, e.g. "464 2068 7586" (required: no default)')
    add_verbose(compare)
    compare.set_defaults(run=cmd_compare)
