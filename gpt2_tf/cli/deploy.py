"""Deployment and conversion: export (a SavedModel), serve (the completions server), convert (HF folders)."""

from __future__ import annotations

import os
import shutil

from ..validate import check_api_key, check_litert, check_new_folder
from .common import (CommandError, add_adapter, add_dtype, add_mode, add_model_arguments, add_model_folder, add_strict,
                     add_verbose, model_folder, open_model)


def cmd_export(args):
    """A SavedModel with serving_default, generate and score signatures, or a LiteRT model (--format litert)."""
    folder = model_folder(args)
    hparams = folder.hparams()
    if args.format == 'litert':
        return export_litert(args, folder, hparams)
    if args.max_len is not None:
        raise CommandError('--max-len is for --format litert; a SavedModel takes any length up to n_ctx')
    check_new_folder(args.out_dir)
    model = open_model(args, folder, device='/CPU:0')
    from ..export import export_saved_model

    export_saved_model(model, args.out_dir, xla=args.xla)
    print(f'{args.out_dir}: SavedModel written (signatures serving_default, generate, score'
          f'{"; XLA-compiled" if args.xla else ""})')


def export_litert(args, folder, hparams) -> None:
    """OUT_DIR/model.tflite with prefill and decode signatures, model.json, and the vocabulary files."""
    check_litert(args.dtype, args.max_len, hparams.n_ctx)
    if args.xla:
        raise CommandError('--xla is for a SavedModel; a LiteRT model runs in the LiteRT interpreter')
    check_new_folder(args.out_dir)
    vocabulary = folder.carried_vocabulary()
    model = open_model(args, folder, device='/CPU:0')
    from ..litert import export_litert as write

    info = write(model, args.out_dir, max_len=args.max_len, vocabulary=vocabulary)
    print(f'{args.out_dir}: LiteRT model written ({info["bytes"] / 1e6:,.1f} MB, {args.dtype}, signatures prefill and '
          f'decode, cache of {info["max_len"]} positions; run it with: python -m gpt2_tf.litert_run {args.out_dir} '
          f'"Hello")')


def cmd_serve(args):
    """An OpenAI-compatible completions server; clients may name the model by any of the folder's names."""
    folder = model_folder(args)
    if not 1 <= args.port <= 65535:
        raise CommandError(f'--port must be in 1..65535, got {args.port}')
    for option, value in (('--max-batch', args.max_batch), ('--queue-size', args.queue_size)):
        if value < 1:
            raise CommandError(f'{option} must be at least 1, got {value}')
    check_api_key(args.api_key, name='--api-key')
    drain = args.timeout_graceful_shutdown
    if drain is not None and not 0 <= drain < float('inf'):
        raise CommandError(f'--timeout-graceful-shutdown must be a number of seconds >= 0, got '
                           f'{drain:g}')
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise CommandError("serving needs the server extra: pip install -e '.[serve]'") from None
    encoder = folder.encoder()
    names = (args.served_model_name,) + folder.names if args.served_model_name else folder.names
    from ..serve import check_port, serve

    check_port(args.host, args.port)  # before the model loads: a taken port fails in a second
    model = open_model(args, folder)
    serve(model, encoder, model_id=names[0], aliases=names[1:], host=args.host, port=args.port,
          api_key=args.api_key, capacity=args.max_batch, queue_size=args.queue_size, mode=args.mode, quiet=args.quiet,
          drain=drain)


def cmd_convert(args):
    """An original-layout folder (or run folder) to a Hugging Face one, or back."""
    from ..hf import TOKENIZER_FILES

    source = model_folder(args)
    check_new_folder(args.destination)
    if args.to == 'hf' and source.layout == 'hf' and not args.adapter:
        raise CommandError(f'{source.path} is already a Hugging Face folder (config.json); use --to original')
    if args.to == 'original' and source.layout != 'hf' and not args.adapter:
        raise CommandError(f'{source.path} is not a Hugging Face folder (no config.json); use --to hf')
    vocabulary = source.carried_vocabulary()
    model = open_model(args, source, device='/CPU:0')
    from ..checkpoint import save_checkpoint, whole_folder
    from ..hf import save_hf

    with whole_folder(args.destination) as staging:  # the folder appears complete, or not at all
        if args.to == 'hf':
            save_hf(model, staging, vocabulary=vocabulary)
        else:
            save_checkpoint(model, staging)
            for original_name, path in zip(TOKENIZER_FILES.values(), vocabulary):
                shutil.copyfile(path, os.path.join(staging, original_name))
    print(f'{args.destination}: written ({args.to})')


def add_commands(commands) -> None:
    export = commands.add_parser('export', help='a SavedModel for TensorFlow Serving, or a LiteRT model for devices')
    add_model_folder(export)
    export.add_argument('out_dir', metavar='OUT_DIR', help='a new folder')
    add_dtype(export)
    export.add_argument('--format', choices=['savedmodel', 'litert'], default='savedmodel',
                        help='a SavedModel, or a LiteRT (TFLite) model with prefill and decode signatures and an '
                             'external KV cache (default: savedmodel)')
    export.add_argument('--max-len', '--max_len', type=int, default=None,
                        help='with --format litert: the KV cache\'s positions (default: n_ctx)')
    export.add_argument('--xla', action='store_true',
                        help='XLA-compile the signatures; TF Serving then needs --xla_cpu_compilation_enabled on '
                             'CPU (default: off)')
    add_verbose(export)
    export.set_defaults(run=cmd_export)

    serve = commands.add_parser('serve', help='an OpenAI-compatible completions server')
    add_model_arguments(serve)
    add_dtype(serve)
    serve.add_argument('--host', default='127.0.0.1', help='address to listen on (default: 127.0.0.1)')
    serve.add_argument('--port', type=int, default=8000, help='port to listen on (default: 8000)')
    serve.add_argument('--api-key', '--api_key', default=None,
                       help='require "Authorization: Bearer KEY" (default: none, no key)')
    serve.add_argument('--served-model-name', '--served_model_name', default=None,
                       help="the model id /v1/models lists; clients may also send the folder's name, its published "
                            "name (124M) or, for the bundled checkpoint, test (default: the model's name)")
    serve.add_argument('--max-batch', '--max_batch', type=int, default=16,
                       help='decoding slots: rows decoded together, joining and leaving between chunks (default: 16)')
    serve.add_argument('--queue-size', '--queue_size', type=int, default=256,
                       help='rows waiting before new requests get 503 (default: 256)')
    serve.add_argument('--timeout-graceful-shutdown', '--timeout_graceful_shutdown', type=float, default=None,
                       metavar='SECONDS', help='on Ctrl-C or SIGTERM, the time the requests in flight have to finish; '
                                               'then they fail, saying the server is shutting down (default: 30)'),
    serve.add_argument('--quiet', action='store_true',
                       help='no access-log line per request on stderr (method, path, status, tokens, latency) '
                            '(default: off)')
    add_mode(serve)
    add_verbose(serve)
    serve.set_defaults(run=cmd_serve)


def add_convert(commands) -> None:
    convert = commands.add_parser('convert', help='an original-layout folder to a Hugging Face one, or back')
    convert.add_argument('model_dir', metavar='SRC',
                         help='the model folder to convert (or a model name, as for MODEL_DIR elsewhere)')
    convert.add_argument('destination', metavar='DST', help='a new folder')
    convert.add_argument('--to', choices=['hf', 'original'], required=True,
                         help='the layout to write (required: no default)')
    add_adapter(convert)  # merged into the weights written
    add_strict(convert)  # a checkpoint with optimizer slots converts without them
    add_verbose(convert)
    convert.set_defaults(run=cmd_convert)

