"""The gpt2-tf command: a thin layer over the library.

    gpt2-tf generate "PROMPT"     conditional samples, like interactive_conditional_samples.py
    gpt2-tf generate              the interactive mode: prompts from the terminal
    gpt2-tf sample                unconditional samples, like generate_unconditional_samples.py
    gpt2-tf score FILE...         per-token log-probabilities and perplexity of text files
    gpt2-tf finetune DATASET      fine-tuning, with gpt-2-simple's options and run folders
    gpt2-tf encode DATASET OUT    a text dataset to an .npz of tokens
    gpt2-tf export MODEL_DIR OUT  a SavedModel for TensorFlow Serving
    gpt2-tf serve                 an OpenAI-compatible completions server
    gpt2-tf convert SRC DST --to hf|original   Hugging Face folders, both ways
    gpt2-tf inspect MODEL_DIR     parameter accounting, from hparams and from the checkpoint
    gpt2-tf explore MODEL_DIR     an HTML page of the block, with the logit lens
    gpt2-tf compare MODEL_DIR     this port against the TF1 graph, block by block

Every argument is checked before TensorFlow loads (it takes seconds, the model
minutes for 1558M); errors are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

DEFAULT_MODEL = '124M'
DEFAULT_MODELS_DIR = 'checkpoints'
BANNER = '=' * 40 + ' SAMPLE {} ' + '=' * 40


class CommandError(Exception):
    """An error to report in one line, without a traceback."""


# --- finding the model, without TensorFlow ------------------------------------------------------

def _incomplete(folder: str) -> bool:
    """A model folder that an interrupted download left behind (.part files, or no index)."""
    names = os.listdir(folder)
    return any(n.endswith('.part') for n in names) or not any(n.endswith('.index') for n in names)


def model_dir(args) -> tuple:
    """(the folder to load, a notice to print before loading it or None): --model_dir, else
    models_dir/model_name, else the bundled test checkpoint."""
    from .assets import bundled_checkpoint
    from .download import PARTIAL
    from .hparams import OLD_NAMES, PUBLISHED

    if args.model_dir:
        if not os.path.isdir(args.model_dir):
            raise CommandError(f'no model folder at {args.model_dir}')
        return args.model_dir, None
    models_dir = os.path.expanduser(args.models_dir or DEFAULT_MODELS_DIR)
    if args.models_dir and not os.path.isdir(models_dir):
        raise CommandError(f'--models_dir {args.models_dir} is not a folder; give the folder that holds '
                           f'the model folders (default: {DEFAULT_MODELS_DIR})')
    name = args.model_name or DEFAULT_MODEL
    path = os.path.join(models_dir, name)
    published = OLD_NAMES.get(name, name) in PUBLISHED
    resume = f'python download_model.py {name}' + (f' --models_dir {args.models_dir}' if args.models_dir else '')
    if os.path.isdir(path):
        if published and _incomplete(path):
            raise CommandError(f'the download in {path} is incomplete: run `{resume}` again to resume it')
        return path, None
    partial = os.path.isdir(path + PARTIAL)
    if args.model_name is None and args.models_dir is None:
        if partial:
            why = (f'the download of {name} is incomplete ({path + PARTIAL}); resume it with `{resume}`. '
                   f'Meanwhile using')
        else:
            why = f'no model at {path}, so using'
        notice = (f'gpt2-tf: {why} the bundled test checkpoint (random weights, 2 tiny layers: the text is '
                  f'gibberish).' + ('' if partial else f' Get a real model with: {resume}'))
        return bundled_checkpoint(), notice
    if partial:
        raise CommandError(f'the download of {name} is incomplete: run `{resume}` again to resume it')
    if not published:
        raise CommandError(f'no model folder {path}, and {name!r} is not a published model '
                           f'({", ".join(PUBLISHED)}); give --model_dir for a folder of your own')
    raise CommandError(f'no model at {path}; download it with: {resume}')


# --- generation ------------------------------------------------------------------------------

def _checked_options(args) -> dict:
    """The sampling options, checked without TensorFlow."""
    from .validate import check_sampling, check_seed

    if args.batch_size < 1:
        raise CommandError(f'--batch_size must be at least 1, got {args.batch_size}')
    if args.nsamples < 0:
        raise CommandError(f'--nsamples must be >= 0, got {args.nsamples}')
    if args.nsamples % args.batch_size:
        raise CommandError(f'--nsamples ({args.nsamples}) must be a multiple of --batch_size ({args.batch_size})')
    check_sampling(args.temperature, args.top_k, args.top_p, 1)
    if args.seed is not None:
        check_seed(args.seed, 1)
    if args.chunk is not None and args.chunk < 1:
        raise CommandError(f'--chunk must be at least 1, got {args.chunk}')
    return dict(batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, mode=args.mode, chunk=args.chunk)


def _prepare(args, conditional: bool):
    """(model folder, hparams, encoder, length), all checked before TensorFlow loads."""
    from .encoder import encoder_for
    from .hparams import HParams
    from .validate import check_length, default_length

    folder, args.notice = model_dir(args)
    hparams = HParams.from_json(os.path.join(folder, 'hparams.json'))
    length = args.length if args.length is not None else default_length(hparams.n_ctx, conditional)
    check_length(length, hparams.n_ctx)
    return folder, hparams, encoder_for(folder), length


def _check_prompt(text: str, encoder, hparams, length: int) -> None:
    from .validate import check_token_ids, check_window

    ids = encoder.encode(text)
    if not ids:
        raise ValueError('the prompt is empty: give some text')
    check_token_ids(ids, hparams.n_vocab, name="the prompt's token")
    check_window(len(ids), length, hparams.n_ctx, what='the prompt')


def _load(args, folder: str):
    """Loads TensorFlow and the model, once every check has passed (the fallback notice comes here, last)."""
    from . import quiet

    if args.notice:
        print(args.notice, file=sys.stderr)
    quiet.tensorflow(verbose=args.verbose)
    quiet.check_device(args.device)
    from .loading import load_model

    return load_model(folder, device=args.device, dtype=getattr(args, 'dtype', 'float32'))


def _run_samples(model, encoder, prompt, length: int, args, options: dict, nsamples: Optional[int]) -> None:
    """Prints each text between the original's banners; on a terminal, a progress bar counts tokens."""
    from tqdm import tqdm

    from .text import iter_samples

    total = None if nsamples is None else nsamples * length
    with tqdm(total=total, desc='generating', unit='tok', file=sys.stderr, leave=False, dynamic_ncols=True,
              mininterval=0, disable=args.quiet or not sys.stderr.isatty()) as bar:  # updates come per chunk
        texts = iter_samples(model, prompt, length, nsamples=nsamples, encoder=encoder, progress=bar.update,
                             **options)
        for number, text in enumerate(texts, start=1):
            tqdm.write(BANNER.format(number), file=sys.stdout)
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()


def cmd_sample(args):
    options = _checked_options(args)
    folder, hparams, encoder, length = _prepare(args, conditional=False)
    model = _load(args, folder)
    _run_samples(model, encoder, None, length, args, options, args.nsamples or None)  # 0: until interrupted


def cmd_generate(args):
    from .validate import room_for_prompt

    options = _checked_options(args)
    if args.nsamples == 0:
        raise CommandError('--nsamples must be at least 1 for generate (sample runs until interrupted with 0)')
    folder, hparams, encoder, length = _prepare(args, conditional=True)
    if args.prompt is not None:
        _check_prompt(args.prompt, encoder, hparams, length)
        model = _load(args, folder)
        _run_samples(model, encoder, args.prompt, length, args, options, args.nsamples)
        return
    try:
        import readline  # noqa: F401  (line editing and history for input(); the prompt goes to the terminal)
    except ImportError:
        pass
    model = _load(args, folder)
    room = room_for_prompt(length, hparams.n_ctx)
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
            print(f'Prompt too long: {count} tokens, and at most {room} fit with --length {length} '
                  f'(prompt + length - 1 <= n_ctx = {hparams.n_ctx}).')
            continue
        _run_samples(model, encoder, prompt, length, args, options, args.nsamples)
        print('=' * 80)


# --- scoring ------------------------------------------------------------------------------------

def _read_text(path: str) -> str:
    if path == '-':
        return sys.stdin.read()
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except FileNotFoundError:
        raise CommandError(f'{path}: no such file') from None
    except IsADirectoryError:
        raise CommandError(f'{path} is a folder: give text files, or - for stdin') from None
    except UnicodeDecodeError as e:
        raise CommandError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start})') from None


def cmd_score(args):
    """Per file: tokens scored, mean NLL (nats/token) and perplexity; --json adds every token."""
    import json
    import math

    from .validate import check_token_ids

    folder, args.notice = model_dir(args)
    from .encoder import encoder_for
    from .hparams import HParams

    hparams = HParams.from_json(os.path.join(folder, 'hparams.json'))
    args.stride = hparams.n_ctx // 2 if args.stride is None else args.stride
    if not 1 <= args.stride <= hparams.n_ctx - 1:
        raise CommandError(f'--stride must be an integer in [1, {hparams.n_ctx - 1}] (n_ctx - 1), got {args.stride}')
    encoder = encoder_for(folder)
    texts = {path: _read_text(path) for path in dict.fromkeys(args.files)}
    encoded = {}
    for path, text in texts.items():
        ids = encoder.encode(text)
        if len(ids) + args.bos < 2:
            raise CommandError(f'{path}: the text has {len(ids)} token(s); scoring needs at least 2'
                               + ('' if args.bos else ' (or 1 with --bos)'))
        check_token_ids(ids, hparams.n_vocab, name=f'{path}: token')
        encoded[path] = ids
    model = _load(args, folder)
    from tqdm import tqdm

    from .scoring import window_log_probs, windows

    for path, ids in encoded.items():
        count = len(windows(len(ids) + args.bos, hparams.n_ctx, args.stride))
        with tqdm(total=count, desc=f'scoring {path}', unit='window', file=sys.stderr, leave=False, mininterval=0,
                  disable=args.quiet or not sys.stderr.isatty()) as bar:
            lp = window_log_probs(model, ids, stride=args.stride, bos=args.bos, progress=bar.update,
                                  end_of_text=encoder.encoder.get('<|endoftext|>', 0))
        nll = float(-lp.astype('float64').mean())
        result = {'file': path, 'tokens': int(lp.size), 'nll': nll, 'perplexity': math.exp(nll)}
        if args.json:
            scored = [None] * (0 if args.bos else 1) + [float(x) for x in lp]
            result['token_pieces'] = [{'id': int(t), 'text': encoder.decode([t]), 'log_prob': scored[i]}
                                      for i, t in enumerate(ids)]
            print(json.dumps(result))
        else:
            print(f'{path}: {result["tokens"]} tokens, mean NLL {nll:.4f} nats/token, '
                  f'perplexity {result["perplexity"]:.3f}')
        sys.stdout.flush()


# --- fine-tuning ----------------------------------------------------------------------------------

def cmd_finetune(args):
    """gpt-2-simple's finetune, with its option names and defaults."""
    for name in ('batch_size', 'accumulate_gradients', 'max_checkpoints', 'sample_num'):
        if getattr(args, name) < 1:
            raise CommandError(f'--{name} must be at least 1, got {getattr(args, name)}')
    if not args.learning_rate > 0:
        raise CommandError(f'--learning_rate must be > 0, got {args.learning_rate}')
    folder, args.notice = model_dir(args)
    from .encoder import encoder_for

    encoder = encoder_for(folder)
    from . import quiet

    if args.notice:
        print(args.notice, file=sys.stderr)
    quiet.tensorflow(verbose=args.verbose)
    from .train import finetune, load_dataset

    from .train import make_strategy

    strategy = make_strategy(args.strategy, timeout=args.collective_timeout) if args.strategy else None
    chunks = load_dataset(args.dataset, encoder, args.combine)
    val = load_dataset(args.val_dataset, encoder, args.combine) if args.val_dataset else None
    finetune(folder, chunks, steps=args.steps, run_name=args.run_name, checkpoint_dir=args.checkpoint_dir,
             learning_rate=args.learning_rate, batch_size=args.batch_size,
             accumulate_gradients=args.accumulate_gradients, sample_every=args.sample_every,
             sample_length=args.sample_length, sample_num=args.sample_num, save_every=args.save_every,
             print_every=args.print_every, max_checkpoints=args.max_checkpoints, restore_from=args.restore_from,
             only_train_transformer_layers=args.only_train_transformer_layers, optimizer=args.optimizer,
             val_dataset=val, val_every=args.val_every, val_batch_size=args.val_batch_size,
             val_batch_count=args.val_batch_count, combine=args.combine, recompute=args.recompute, seed=args.seed,
             log=lambda line: print(line, flush=True), strategy=strategy)


def cmd_encode(args):
    """A text dataset to an .npz of token chunks, as gpt-2-simple's encode_dataset."""
    from .encoder import get_encoder
    from .train import encode_dataset

    count = encode_dataset(args.dataset, args.out, get_encoder(), args.combine)
    print(f'{args.out}: {count:,} tokens')


# --- deployment ----------------------------------------------------------------------------------

def cmd_export(args):
    """A SavedModel with serving_default, generate and score signatures."""
    from . import quiet

    folder = _model_folder_argument(args.model_dir)
    if os.path.exists(args.out_dir) and os.listdir(args.out_dir):
        raise CommandError(f'{args.out_dir} exists and is not empty: export into a new folder')
    quiet.tensorflow(verbose=args.verbose)
    from .loading import load_model
    from .export import export_saved_model

    export_saved_model(load_model(folder, device='/CPU:0', dtype=args.dtype), args.out_dir, xla=args.xla)
    print(f'{args.out_dir}: SavedModel written (signatures serving_default, generate, score'
          f'{"; XLA-compiled" if args.xla else ""})')


def cmd_serve(args):
    """An OpenAI-compatible completions server."""
    from . import quiet

    folder, notice = model_dir(args)
    if not 1 <= args.port <= 65535:
        raise CommandError(f'--port must be in 1..65535, got {args.port}')
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise CommandError("serving needs the server extra: pip install -e '.[serve]'") from None
    from .encoder import encoder_for

    encoder = encoder_for(folder)
    if notice:
        print(notice, file=sys.stderr)
    quiet.tensorflow(verbose=args.verbose)
    quiet.check_device(args.device)
    from .loading import load_model
    from .serve import serve

    name = args.served_model_name or os.path.basename(os.path.normpath(folder))
    print(f'gpt2-tf: serving {name} on http://{args.host}:{args.port}/v1 (Ctrl-C to stop)', file=sys.stderr)
    serve(load_model(folder, device=args.device, dtype=args.dtype), encoder, model_id=name, host=args.host, port=args.port,
          api_key=args.api_key, capacity=args.max_batch, queue_size=args.queue_size, mode=args.mode)


def cmd_explore(args):
    """One self-contained HTML page of the block, for a checkpoint and a prompt."""
    from . import quiet
    from .encoder import encoder_for
    from .hparams import HParams

    folder = _model_folder_argument(args.model_dir)
    hparams = HParams.from_json(os.path.join(folder, 'hparams.json'))
    encoder = encoder_for(folder)
    tokens = encoder.encode(args.prompt)
    if not tokens:
        raise CommandError('--prompt is empty: give some text')
    if len(tokens) > hparams.n_ctx:
        raise CommandError(f'--prompt has {len(tokens)} tokens, more than n_ctx = {hparams.n_ctx}')
    out = os.path.abspath(args.output)
    if not os.path.isdir(os.path.dirname(out)) or not os.access(os.path.dirname(out), os.W_OK):
        raise CommandError(f'cannot write {args.output}: {os.path.dirname(out)} is not a writable folder')
    quiet.tensorflow(verbose=args.verbose)
    from .loading import load_model
    from .explorer import write_report

    write_report(load_model(folder, dtype=args.dtype), encoder, args.prompt, out, model_dir=folder)
    print(f'{args.output}: written ({len(tokens)} tokens, {hparams.n_layer} blocks)')


# --- conversion ---------------------------------------------------------------------------------

def cmd_convert(args):
    """An original-layout folder to a Hugging Face one, or back."""
    import shutil

    from . import quiet
    from .hf import TOKENIZER_FILES, is_hf_folder

    source = _model_folder_argument(args.source)
    if os.path.exists(args.destination) and os.listdir(args.destination):
        raise CommandError(f'{args.destination} exists and is not empty: convert into a new folder')
    if args.to == 'hf' and is_hf_folder(source):
        raise CommandError(f'{source} is already a Hugging Face folder (config.json); use --to original')
    if args.to == 'original' and not is_hf_folder(source):
        raise CommandError(f'{source} is not a Hugging Face folder (no config.json); use --to hf')
    quiet.tensorflow(verbose=args.verbose)
    from .checkpoint import save_checkpoint
    from .loading import load_model
    from .hf import save_hf

    model = load_model(source, device='/CPU:0')
    if args.to == 'hf':
        own = [os.path.join(source, name) for name in TOKENIZER_FILES.values()]
        save_hf(model, args.destination, vocabulary=own if all(map(os.path.exists, own)) else None)
    else:
        save_checkpoint(model, args.destination)
        from .assets import bundled_vocabulary

        hf_names = [os.path.join(source, name) for name in TOKENIZER_FILES]
        files = hf_names if all(map(os.path.exists, hf_names)) else bundled_vocabulary()
        for original_name, path in zip(TOKENIZER_FILES.values(), files):
            shutil.copyfile(path, os.path.join(args.destination, original_name))
    print(f'{args.destination}: written ({args.to})')


# --- inspection ---------------------------------------------------------------------------------

def _model_folder_argument(path: str) -> str:
    if not os.path.isdir(path):
        what = 'a file' if os.path.exists(path) else 'not there'
        raise CommandError(f'{path} is {what}: give a model folder (hparams.json and a checkpoint)')
    return path


def cmd_inspect(args):
    import json

    from . import quiet

    folder = _model_folder_argument(args.model_dir)
    quiet.tensorflow(verbose=args.verbose)
    from .diagnostics import format_table, parameter_table

    table = parameter_table(folder)
    print(json.dumps(table, indent=2) if args.json else format_table(table))
    if table['mismatches']:
        raise CommandError(f'{len(table["mismatches"])} component(s) disagree with hparams.json')


def cmd_compare(args):
    from . import quiet
    from .hparams import HParams
    from .validate import check_sequence, check_token_ids

    folder = _model_folder_argument(args.model_dir)
    try:
        tokens = [int(t) for t in args.tokens.replace(',', ' ').split()]
    except ValueError:
        raise CommandError(f'--tokens takes token ids separated by spaces, e.g. "464 2068"; got {args.tokens!r}') \
            from None
    if not tokens:
        raise CommandError('--tokens is empty: give at least one token id, e.g. "464 2068"')
    hparams = HParams.from_json(os.path.join(folder, 'hparams.json'))
    check_token_ids(tokens, hparams.n_vocab)
    check_sequence(0, len(tokens), hparams.n_ctx)
    quiet.tensorflow(verbose=args.verbose)
    from .diagnostics import compare, format_comparison

    report = compare(folder, [tokens])
    print(format_comparison(report))
    if report['first_divergence'] is not None:
        sys.exit(1)


# --- the parser ---------------------------------------------------------------------------------

def _add_model_arguments(parser):
    parser.add_argument('--model_name', '--model-name', default=None,
                        help=f'which model folder under models_dir (default {DEFAULT_MODEL})')
    parser.add_argument('--models_dir', '--models-dir', default=None,
                        help=f'the folder holding model folders (default: {DEFAULT_MODELS_DIR})')
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
    parser.add_argument('--temperature', type=float, default=1.0, help='in [0, 2]; 0 is greedy (default 1)')
    parser.add_argument('--top_k', '--top-k', type=int, default=0, help='0: no truncation (default 0)')
    parser.add_argument('--top_p', '--top-p', type=float, default=1.0, help='nucleus sampling (default 1: off)')
    parser.add_argument('--mode', choices=['xla', 'function', 'eager'], default=None,
                        help='how the decode loop runs (default: xla for float32 weights, function for reduced)')
    parser.add_argument('--chunk', type=int, default=None,
                        help='tokens per compiled call of the decode loop (default 32)')
    parser.add_argument('--quiet', action='store_true', help='no progress bar on stderr')


def _add_dtype(parser):
    parser.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'], default='float32',
                        help='the weights\' precision (default float32, exact; see the README for speed and fidelity)')


def _add_generation_arguments(parser, *, nsamples):
    """What generate and sample share: the model, its dtype, the sampling options."""
    _add_model_arguments(parser)
    _add_dtype(parser)
    _add_sampling_arguments(parser, nsamples=nsamples)
    _add_verbose(parser)


def _add_verbose(parser):
    parser.add_argument('--verbose', action='store_true', help="show TensorFlow's start-up messages")


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog='gpt2-tf', description='GPT-2 on TensorFlow 2, faithful to the original.')
    commands = main.add_subparsers(dest='command', required=True, metavar='COMMAND')

    generate = commands.add_parser('generate', help='samples after a prompt; without one, read prompts interactively')
    generate.add_argument('prompt', nargs='?', default=None, help='the prompt text (omit for the interactive mode)')
    _add_generation_arguments(generate, nsamples=1)
    generate.set_defaults(run=cmd_generate)

    sample = commands.add_parser('sample', help='unconditional samples')
    _add_generation_arguments(sample, nsamples=0)
    sample.set_defaults(run=cmd_sample)

    score = commands.add_parser('score', help='per-token log-probabilities and perplexity of text files')
    score.add_argument('files', nargs='+', metavar='FILE', help='UTF-8 text files; - reads stdin')
    _add_model_arguments(score)
    _add_dtype(score)
    score.add_argument('--stride', type=int, default=None,
                       help='new tokens scored per window of n_ctx tokens (default n_ctx // 2, 512 for '
                            'GPT-2): each token is scored once, with at least n_ctx - stride tokens of context')
    score.add_argument('--bos', action='store_true', help='score the first token too, after <|endoftext|>')
    score.add_argument('--json', action='store_true', help='one JSON object per file, with every token')
    score.add_argument('--quiet', action='store_true', help='no progress bar on stderr')
    _add_verbose(score)
    score.set_defaults(run=cmd_score)

    finetune = commands.add_parser('finetune', help="fine-tune on a dataset, with gpt-2-simple's options")
    finetune.add_argument('dataset', help='a text file, a folder or glob of .txt files, or an .npz of tokens')
    _add_model_arguments(finetune)
    for flag, kind, default, text in [
            ('--run_name', str, 'run1', 'the run folder under checkpoint_dir'),
            ('--checkpoint_dir', str, 'checkpoint', 'where run folders go'),
            ('--steps', int, -1, 'updates to run (-1: until interrupted)'),
            ('--learning_rate', float, 1e-4, None), ('--batch_size', int, 1, 'windows per micro-batch'),
            ('--accumulate_gradients', int, 5, 'micro-batches per update'),
            ('--sample_every', int, 100, None), ('--sample_length', int, 1023, None), ('--sample_num', int, 1, None),
            ('--save_every', int, 1000, None), ('--print_every', int, 1, None), ('--max_checkpoints', int, 1, None),
            ('--optimizer', str, 'adam', 'adam or sgd'), ('--val_dataset', str, None, None),
            ('--val_every', int, 0, None), ('--val_batch_size', int, 2, None), ('--val_batch_count', int, 40, None),
            ('--combine', int, 50000, 'characters of text per encoded chunk'),
            ('--seed', int, None, 'fix to reproduce the windows and samples')]:
        finetune.add_argument(flag, type=kind, default=default, help=text and f'{text} (default {default})')
    finetune.add_argument('--restore_from', choices=['latest', 'fresh'], default='latest')
    finetune.add_argument('--strategy', choices=['mirrored', 'multiworker'], default=None,
                          help="data-parallel: this host's devices, or the hosts in TF_CONFIG")
    finetune.add_argument('--collective_timeout', type=float, default=300.0,
                          help='seconds before a silent worker stops the run (default 300)')
    finetune.add_argument('--only_train_transformer_layers', action='store_true')
    finetune.add_argument('--recompute', '--use_memory_saving_gradients', action='store_true',
                          help="recompute each block's activations in the backward pass (less memory)")
    _add_verbose(finetune)
    finetune.set_defaults(run=cmd_finetune)

    encode = commands.add_parser('encode', help="a text dataset to an .npz of tokens (gpt-2-simple's encode_dataset)")
    encode.add_argument('dataset')
    encode.add_argument('out', help='the .npz to write')
    encode.add_argument('--combine', type=int, default=50000, help='characters of text per chunk (default 50000)')
    encode.set_defaults(run=cmd_encode, verbose=False)

    export = commands.add_parser('export', help='a SavedModel for TensorFlow Serving')
    export.add_argument('model_dir', metavar='MODEL_DIR')
    export.add_argument('out_dir', metavar='OUT_DIR', help='a new folder')
    _add_dtype(export)
    export.add_argument('--xla', action='store_true',
                        help='XLA-compile the signatures (TF Serving then needs --xla_cpu_compilation_enabled on CPU)')
    _add_verbose(export)
    export.set_defaults(run=cmd_export)

    serve = commands.add_parser('serve', help='an OpenAI-compatible completions server')
    _add_model_arguments(serve)
    _add_dtype(serve)
    serve.add_argument('--host', default='127.0.0.1', help='address to listen on (default 127.0.0.1)')
    serve.add_argument('--port', type=int, default=8000)
    serve.add_argument('--api-key', '--api_key', default=None, help='require "Authorization: Bearer KEY"')
    serve.add_argument('--served-model-name', '--served_model_name', default=None,
                       help="the model id clients send (default: the model folder's name)")
    serve.add_argument('--max-batch', '--max_batch', type=int, default=16, help='rows per decode call (default 16)')
    serve.add_argument('--queue-size', '--queue_size', type=int, default=256,
                       help='rows waiting before new requests get 503 (default 256)')
    serve.add_argument('--mode', choices=['xla', 'function', 'eager'], default=None)
    _add_verbose(serve)
    serve.set_defaults(run=cmd_serve)

    explore = commands.add_parser('explore', help='an HTML page of the block: attention, the logit lens, ...')
    explore.add_argument('model_dir', metavar='MODEL_DIR')
    explore.add_argument('--prompt', required=True)
    explore.add_argument('-o', '--output', default='report.html', help='the HTML file (default report.html)')
    _add_dtype(explore)
    _add_verbose(explore)
    explore.set_defaults(run=cmd_explore)

    convert = commands.add_parser('convert', help='an original-layout folder to a Hugging Face one, or back')
    convert.add_argument('source', metavar='SRC')
    convert.add_argument('destination', metavar='DST', help='a new folder')
    convert.add_argument('--to', choices=['hf', 'original'], required=True)
    _add_verbose(convert)
    convert.set_defaults(run=cmd_convert)

    inspect = commands.add_parser('inspect', help='parameter accounting of a model folder')
    inspect.add_argument('model_dir')
    inspect.add_argument('--json', action='store_true', help='machine-readable output')
    _add_verbose(inspect)
    inspect.set_defaults(run=cmd_inspect)

    compare = commands.add_parser('compare', help='max |diff| per block and state against the TF1 graph')
    compare.add_argument('model_dir')
    compare.add_argument('--tokens', required=True, help='token ids, e.g. "464 2068 7586"')
    _add_verbose(compare)
    compare.set_defaults(run=cmd_compare)
    return main


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (CommandError, ValueError, OSError, RuntimeError) as e:  # CheckpointError is a ValueError
        message = (getattr(e, 'message', None) or str(e) or type(e).__name__).strip().splitlines()[0]
        print(f'gpt2-tf: error: {message}', file=sys.stderr)
        return 2
    except Exception as e:  # TensorFlow's own errors: still one line, with --verbose for the details
        if getattr(args, 'verbose', False):
            raise
        if type(e).__module__.startswith('tensorflow'):
            message = (getattr(e, 'message', None) or str(e)).strip().splitlines()[0]
            print(f'gpt2-tf: error: {message} (run with --verbose for details)', file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == '__main__':
    sys.exit(main())
