"""Text out and text in: generate (with its interactive mode), sample, and score."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Optional

from ..encoder import END_OF_TEXT
from .common import (BANNER, CommandError, add_dtype, add_mode, add_model_arguments, add_quiet, add_verbose,
                     model_folder, open_model)


# --- checks, before TensorFlow -----------------------------------------------------------------

def logit_bias(text: str) -> dict:
    """--logit_bias's type: 'ID:BIAS,ID:BIAS' -> {id: bias} (the ids and biases are checked in prepare)."""
    try:
        pairs = [item.split(':') for item in text.split(',')]
        return {int(token): float(bias) for token, bias in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f'give token ids and biases as ID:BIAS pairs separated by commas, '
                                         f'e.g. 50256:-100,198:5; got {text!r}') from None


PENALTIES = {'logit_bias': None, 'presence_penalty': 0, 'frequency_penalty': 0, 'repetition_penalty': 1}  # off


def checked_options(args) -> dict:
    """The sampling options, checked without TensorFlow; the penalties only where set."""
    from ..validate import check_penalties, check_sampling, check_seed

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
    check_penalties(args.presence_penalty, args.frequency_penalty, args.repetition_penalty, 1)
    penalties = {name: getattr(args, name) for name, off in PENALTIES.items() if getattr(args, name) != off}
    return dict(batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, mode=args.mode, chunk=args.chunk, **penalties)


def prepare(args, conditional: bool):
    """(model folder, hparams, encoder, length), all checked before TensorFlow loads."""
    from ..validate import check_length, check_logit_bias, default_length

    folder = model_folder(args)
    hparams = folder.hparams()
    check_logit_bias(args.logit_bias, 1, hparams.n_vocab)
    length = args.length if args.length is not None else default_length(hparams.n_ctx, conditional)
    check_length(length, hparams.n_ctx)
    encoder = folder.encoder()
    start = encoder.encoder.get(END_OF_TEXT)
    if not conditional and (start is None or start >= hparams.n_vocab):
        raise CommandError(f'unconditional samples start from <|endoftext|>, which '
                           + ('this vocabulary does not have' if start is None else
                              f'is token {start}, outside the model\'s vocabulary [0, {hparams.n_vocab})')
                           + ': give a prompt with generate')
    return folder, hparams, encoder, length


def check_prompt(text: str, encoder, hparams, length: int, *, empty: str = 'the prompt is empty: give some text'):
    from ..validate import check_token_ids, check_utf8, check_window

    check_utf8(text)
    ids = encoder.encode(text)
    if not ids:
        raise CommandError(empty)
    check_token_ids(ids, hparams.n_vocab, name="the prompt's token", encoded=True)
    check_window(len(ids), length, hparams.n_ctx, what='the prompt')


PROMPT = 'Model prompt >>> '  # the original's


# --- generation ---------------------------------------------------------------------------------

def run_samples(model, encoder, prompt, length: int, args, options: dict, nsamples: Optional[int]) -> None:
    """Prints each text between the original's banners; on a terminal, a progress bar counts tokens."""
    from tqdm import tqdm

    from ..text import iter_samples

    total = None if nsamples is None else nsamples * length
    with tqdm(total=total, desc='generating', unit='tok', file=sys.stderr, leave=False, dynamic_ncols=True,
              mininterval=0, disable=args.quiet or not sys.stderr.isatty()) as bar:  # updates come per chunk
        texts = iter_samples(model, prompt, length, nsamples=nsamples, encoder=encoder, progress=bar.update,
                             **options)
        for number, text in enumerate(texts, start=1):
            tqdm.write(BANNER.format(number), file=sys.stdout)
            try:
                tqdm.write(text, file=sys.stdout)
            except UnicodeEncodeError:
                raise CommandError(f"stdout's encoding ({sys.stdout.encoding}) cannot write the samples' text: "
                                   f"set PYTHONIOENCODING=utf-8") from None
            sys.stdout.flush()


def cmd_sample(args):
    options = checked_options(args)
    folder, hparams, encoder, length = prepare(args, conditional=False)
    model = open_model(args, folder, decodes=True)
    run_samples(model, encoder, None, length, args, options, args.nsamples or None)  # 0: until interrupted


def cmd_generate(args):
    options = checked_options(args)
    if args.nsamples == 0:
        raise CommandError('--nsamples must be at least 1 for generate (sample runs until interrupted with 0)')
    folder, hparams, encoder, length = prepare(args, conditional=True)
    if args.prompt is not None:
        check_prompt(args.prompt, encoder, hparams, length)
        model = open_model(args, folder, decodes=True)
        run_samples(model, encoder, args.prompt, length, args, options, args.nsamples)
        return
    try:
        import readline  # noqa: F401  (line editing and history for input(); the prompt goes to the terminal)
    except ImportError:
        pass
    interactive(open_model(args, folder, decodes=True), encoder, hparams, length, args, options)


def interactive(model, encoder, hparams, length: int, args, options: dict) -> None:
    """Prompts from the terminal until end of input; Ctrl-C stops a generation and returns to the prompt.

    The prompt and the refusals go to the terminal: stdout when it is one, else stderr, so that samples
    redirected to a file hold samples only. With --seed s, the k-th prompt sampled (from 0) draws with
    seed s + k, as `generate PROMPT --seed s+k` would: the session is reproducible, and a prompt typed
    again draws new samples, as in the original, whose seed is set once per session."""
    aside = sys.stdout if sys.stdout.isatty() else sys.stderr
    if hasattr(sys.stdin, 'reconfigure'):  # bytes that are not UTF-8 arrive as lone surrogates, refused below,
        sys.stdin.reconfigure(errors='surrogateescape')  # rather than failing the read and dropping what follows
    for number in itertools.count():
        seed = options['seed'] if options['seed'] is None else session_seed(options['seed'], number)
        if not next_prompt_samples(model, encoder, hparams, length, args, {**options, 'seed': seed}, aside):
            return


def session_seed(seed: int, number: int) -> int:
    """seed + number, wrapped into int64 as the seeds are."""
    return (seed + number + 2 ** 63) % 2 ** 64 - 2 ** 63


def next_prompt_samples(model, encoder, hparams, length: int, args, options: dict, aside) -> bool:
    """Reads prompts until one is accepted and prints its samples: True, or False at end of input."""
    while True:
        try:
            prompt = read_prompt(aside)
        except EOFError:
            print(file=aside)
            return False
        refused = refusal(prompt, encoder, hparams, length)
        if refused:
            print(refused, file=aside)
            continue
        try:
            run_samples(model, encoder, prompt, length, args, options, args.nsamples)
        except KeyboardInterrupt:
            print('\n(interrupted; Ctrl-C at the prompt or Ctrl-D quits)', file=sys.stderr, flush=True)
            return True
        print('=' * 80)
        return True


def refusal(prompt: str, encoder, hparams, length: int) -> Optional[str]:
    """Why interactive mode asks again for a prompt (an empty one in the original's words), or None."""
    from ..validate import GPT2Error, undecodable

    if undecodable(prompt) is not None:
        return 'Prompt is not UTF-8 text: type it again.'
    try:
        check_prompt(prompt, encoder, hparams, length, empty='Prompt should not be empty!')
    except GPT2Error as e:
        return str(e)
    return None


def read_prompt(aside) -> str:
    """A line of stdin, the prompt shown on `aside` (through input() on stdout, so that line editing redraws it)."""
    if aside is sys.stdout:
        return input(PROMPT)
    print(PROMPT, end='', file=aside, flush=True)
    return input()


# --- scoring ------------------------------------------------------------------------------------

def read_text(path: str) -> str:
    """A file's text, or stdin's for '-', as strict UTF-8 either way, line breaks (\\r\\n, \\r) read as \\n, as
    encode and finetune read them."""
    from ..corpus import open_text

    try:
        with open_text(path) as f:
            return f.read()
    except FileNotFoundError:
        raise CommandError(f'{path}: no such file; check the path') from None
    except IsADirectoryError:
        raise CommandError(f'{path} is a folder: give text files, or - for stdin') from None
    except UnicodeDecodeError as e:
        raise CommandError(f'{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert it first, '
                           f'e.g. iconv -t UTF-8') from None


def encoded_files(args, encoder, hparams) -> dict:
    """{path: token ids} for each file, checked (at least 2 tokens, or 1 with --bos)."""
    from ..validate import check_token_ids

    encoded = {}
    for path in dict.fromkeys(args.files):
        ids = encoder.encode(read_text(path))
        if len(ids) + args.bos < 2:
            raise CommandError(f'{path}: the text has {len(ids)} token(s); scoring needs at least 2'
                               + ('' if args.bos else ' (or 1 with --bos)'))
        check_token_ids(ids, hparams.n_vocab, name=f'{path}: token', encoded=True)
        encoded[path] = ids
    return encoded


def cmd_score(args):
    """Per file: tokens scored, mean NLL (nats/token) and perplexity; --json adds every token."""
    from ..validate import check_stride

    folder = model_folder(args)
    hparams = folder.hparams()
    check_stride(args.stride, hparams.n_ctx)  # before any file is read
    encoder = folder.encoder()
    if args.bos and END_OF_TEXT not in encoder.encoder:
        raise CommandError('--bos puts <|endoftext|> before the text, and this vocabulary has none: '
                           'score without --bos')
    encoded = encoded_files(args, encoder, hparams)
    model = open_model(args, folder)
    from tqdm import tqdm

    from ..scoring import default_stride, summary, window_log_probs, windows

    stride = default_stride(hparams) if args.stride is None else args.stride
    for path, ids in encoded.items():
        count = len(windows(len(ids) + args.bos, hparams.n_ctx, stride))
        with tqdm(total=count, desc=f'scoring {path}', unit='window', file=sys.stderr, leave=False, mininterval=0,
                  disable=args.quiet or not sys.stderr.isatty()) as bar:
            options = dict(stride=stride, progress=bar.update)
            if args.bos:  # a vocabulary without <|endoftext|> scores without it (refused above with --bos)
                options.update(bos=True, end_of_text=encoder.encoder[END_OF_TEXT])
            lp = window_log_probs(model, ids, **options)
        result = summary(lp)
        if args.json:
            scored = [None] * (0 if args.bos else 1) + [float(x) for x in lp]
            pieces = [{'id': int(t), 'text': encoder.decode([t]), 'log_prob': scored[i]} for i, t in enumerate(ids)]
            print(json.dumps({'file': path, 'tokens': result['tokens'], 'nll': result['nll'],
                              'perplexity': result['perplexity'], 'token_pieces': pieces}))
        else:
            print(f'{path}: {result["tokens"]} tokens, mean NLL {result["nll"]:.4f} nats/token, '
                  f'perplexity {result["perplexity"]:.3f}')
        sys.stdout.flush()


# --- the parsers --------------------------------------------------------------------------------

def add_sampling_arguments(parser, *, nsamples: int) -> None:
    parser.add_argument('--seed', type=int, default=None, help='fix to reproduce results (default: none, random)')
    parser.add_argument('--nsamples', type=int, default=nsamples,
                        help=f'samples to print{" (0: until interrupted)" if nsamples == 0 else ""}'
                             f' (default: {nsamples})')
    parser.add_argument('--batch_size', '--batch-size', type=int, default=1,
                        help='samples generated together; must divide nsamples (default: 1)')
    parser.add_argument('--length', type=int, default=None,
                        help='new tokens per sample (default: half the window after a prompt, '
                             'the whole window without one)')
    parser.add_argument('--temperature', type=float, default=1.0, help='in [0, 2]; 0 is greedy (default: 1)')
    parser.add_argument('--top_k', '--top-k', type=int, default=0, help='0: no truncation (default: 0)')
    parser.add_argument('--top_p', '--top-p', type=float, default=1.0, help='nucleus sampling (default: 1, off)')
    add_penalty_arguments(parser)
    add_mode(parser)
    parser.add_argument('--chunk', type=int, default=None,
                        help='tokens per compiled call of the decode loop (default: 32)')
    add_quiet(parser)


def add_penalty_arguments(parser) -> None:
    """OpenAI's and HF's penalties (gpt2_tf.penalties), applied in this order before the temperature."""
    parser.add_argument('--repetition_penalty', '--repetition-penalty', type=float, default=1.0,
                        help="in [0.01, 100]: divides the positive logits (multiplies the negative ones) of the "
                             "prompt's and the generated tokens (default: 1, off)")
    parser.add_argument('--frequency_penalty', '--frequency-penalty', type=float, default=0.0,
                        help='in [-2, 2]: subtracted from a logit once per time its token was generated '
                             '(default: 0, off)')
    parser.add_argument('--presence_penalty', '--presence-penalty', type=float, default=0.0,
                        help='in [-2, 2]: subtracted from the logit of each token generated so far (default: 0, off)')
    parser.add_argument('--logit_bias', '--logit-bias', type=logit_bias, default=None, metavar='ID:BIAS,...',
                        help='biases in [-100, 100] added to token ids\' logits; -100 bans a token, 100 forces it '
                             '(unless the logits differ by 100 - 19.5 x temperature or more; see the README) '
                             '(default: none)')


def add_generation_arguments(parser, *, nsamples: int) -> None:
    """What generate and sample share: the model, its dtype, the sampling options."""
    add_model_arguments(parser)
    add_dtype(parser)
    add_sampling_arguments(parser, nsamples=nsamples)
    add_verbose(parser)


def add_commands(commands) -> None:
    generate = commands.add_parser('generate', help='samples after a prompt; without one, read prompts interactively')
    generate.add_argument('prompt', nargs='?', default=None, help='the prompt text (omit for the interactive mode)')
    add_generation_arguments(generate, nsamples=1)
    generate.set_defaults(run=cmd_generate)

    sample = commands.add_parser('sample', help='unconditional samples')
    add_generation_arguments(sample, nsamples=0)
    sample.set_defaults(run=cmd_sample)

    score = commands.add_parser('score', help='per-token log-probabilities and perplexity of text files')
    score.add_argument('files', nargs='+', metavar='FILE', help='UTF-8 text files; - reads stdin')
    add_model_arguments(score)
    add_dtype(score)
    score.add_argument('--stride', type=int, default=None,
                       help='new tokens scored per window of n_ctx tokens: each token is scored once, with at least '
                            'n_ctx - stride tokens of context (default: n_ctx // 2, 512 for GPT-2)')
    score.add_argument('--bos', action='store_true',
                       help='score the first token too, after <|endoftext|> (default: off)')
    score.add_argument('--json', action='store_true', help='one JSON object per file, with every token (default: off)')
    add_quiet(score)
    add_verbose(score)
    score.set_defaults(run=cmd_score)

