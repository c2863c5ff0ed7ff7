"""Batch inference with Apache Beam: a ModelHandler for RunInference, and a ready pipeline.

    python -m gpt2_tf.beam score    --model_dir D --input 'texts/*.txt' --output out/scores [beam options]
    python -m gpt2_tf.beam generate --model_dir D --input prompts.jsonl --output out/samples --length 40
    python -m gpt2_tf.beam encode   --input 'texts/' --output train.bin [--model_dir D] [--glob '*.txt']

Input is text lines (key = file:line) or JSONL objects with `key` and `text`;
output is JSONL, one record per input with its key and the result (`text` and
`tokens` for generate; `log_probs`, `nll`, `tokens` for score) or an `error`.
The pipeline is a few named transforms: Read, Tokenize (bad inputs become
error records here, never a failed pipeline), RunInference, Format, Write.

encode writes the token file gpt2_tf.corpus.encode_corpus writes for the same
files, byte for byte, sidecar included: each file is an element, encoded in
pieces to its own shard next to the output (in parallel, on any runner whose
workers see that path), and one last step joins the shards in path order into
OUT.partial and renames it.

Element seeds derive from the pipeline's seed and the element's key, so a
result does not depend on how Beam batches; batches are padded to 1, 2, 4 or 8
rows so that workers compile a few shapes. Inputs are checked by the library's
rules (validate.py): options when the handler is made, each element's window
and token ids in Tokenize. Needs the beam extra: pip install -e '.[beam]'.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import hashlib
import json
import os
import posixpath
import shutil
import sys
import tempfile
from typing import Any, Dict, Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.ml.inference.base import ModelHandler, RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from . import corpus, validate
from .hparams import HF_CONFIG
from .loading import resolve

# Rows per model call; a batch is padded up to the next of these. Rows pad by powers of two, not by
# compiled.bucket (8, 16, 32, ...: for sequence lengths, where 8 is small): a lone element would cost 8 rows.
BATCH_SIZES = (1, 2, 4, 8)
INFERENCE = ('score', 'generate')
TASKS = INFERENCE + ('encode',)


# --- model folders on Beam's file systems (gs://bucket/124M) ----------------------------------------------

SETTINGS = ('hparams.json', HF_CONFIG)  # what resolve() reads of a folder: enough to check the options


def is_remote(path) -> bool:
    """Whether path is read through Beam's file systems (gs://bucket/124M), not as a path of this machine."""
    return '://' in os.fspath(path)


def matched(pattern: str) -> list:
    """The paths Beam's file systems find for pattern, sorted; a scheme that no installed file system reads
    (gs:// without apache-beam[gcp]) is refused in one line."""
    try:
        return sorted(m.path for m in FileSystems.match([pattern])[0].metadata_list)
    except ValueError as e:  # Beam's message names the package that reads the scheme
        raise validate.GPT2Error(f'{pattern}: {validate.first_line(e)}') from None


@functools.lru_cache(maxsize=None)
def local_folder(model_dir: str, names: Optional[tuple] = None) -> str:
    """model_dir as a folder of this machine: itself when it is one; a remote folder's files (its top level,
    only those of `names` when given) copied once per process into a temporary folder, removed at exit."""
    if not is_remote(model_dir):
        return model_dir
    paths = matched(posixpath.join(model_dir.rstrip('/'), '*'))
    if names is not None:
        paths = [path for path in paths if posixpath.basename(path) in names]
    if not paths:
        raise validate.GPT2Error(f'{model_dir}: no model files there; give a model folder (hparams.json and a '
                                 f'checkpoint, or an HF config.json)')
    copy = tempfile.mkdtemp(prefix='gpt2_tf-model-')
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    for path in paths:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as source, \
                open(os.path.join(copy, posixpath.basename(path)), 'wb') as target:
            shutil.copyfileobj(source, target, 1 << 24)
    return copy


def element_seed(seed: int, key: str) -> list:
    """The row seed of an element: the pipeline's seed and 64 bits of the key's sha256."""
    digest = int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'little', signed=True)
    return [int(seed), digest]


class Loaded:
    """What a worker loads once: the model and its encoder (Beam shares it by weak reference)."""

    def __init__(self, model, encoder):
        self.model, self.encoder = model, encoder


def _padded(rows: list) -> list:
    """rows, with the first repeated up to the next of BATCH_SIZES."""
    size = next(s for s in BATCH_SIZES if s >= len(rows)) if len(rows) <= BATCH_SIZES[-1] else len(rows)
    return rows + [rows[0]] * (size - len(rows))


class GPT2ModelHandler(ModelHandler):
    """A thin adapter for RunInference: loads the checkpoint once per worker, runs a batch through the library.

    Elements are dicts with `key` and `ids` (token ids); results are dicts with
    `key` and the task's fields. task='score' gives per-token log-probs, mean NLL
    and the count scored (texts longer than n_ctx are scored in windows of
    `stride`); task='generate' gives `length` new tokens and their text.
    """

    def __init__(self, model_dir: str, task: str, *, length: int = 40, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stride: Optional[int] = None, max_batch_size: int = 8,
                 threads: Optional[int] = None):
        if task not in INFERENCE:
            raise validate.GPT2Error(f'task must be one of {INFERENCE}, got {task!r}')
        # A folder or a model name, as every command takes, or a folder on Beam's file systems (its settings
        # only, here; each worker copies the whole folder).
        folder = resolve(local_folder(model_dir, SETTINGS))
        if task == 'generate':  # what score does not read, it does not check
            validate.check_sampling(temperature, top_k, top_p, 1)
            validate.check_length(length, folder.hparams().n_ctx)
            validate.check_seed(seed, 1)
        validate.check_stride(stride, folder.hparams().n_ctx)
        self.model_dir = model_dir if is_remote(model_dir) else folder.checkpoint or folder.path  # or one save
        self.task, self.length, self.seed, self.stride = task, length, seed, stride
        self.options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.max_batch_size = min(max_batch_size, BATCH_SIZES[-1])
        self.threads = threads  # TensorFlow's threads per worker (None: its own choice, every core)

    def load_model(self):
        from . import quiet

        tf = quiet.tensorflow()
        if self.threads:  # before the first op; several workers on one machine then share its cores
            try:
                tf.config.threading.set_intra_op_parallelism_threads(self.threads)
            except RuntimeError:  # TensorFlow already runs in this process, with the threads it has
                pass
        from .loading import load_model
        from .encoder import encoder_for

        folder = local_folder(self.model_dir)
        return Loaded(load_model(folder), encoder_for(folder))

    def batch_elements_kwargs(self) -> Dict[str, Any]:
        # Always full batches, as a plain loop takes them: BatchElements' adaptive sizing otherwise starts at
        # one row and settles on 2 or 3 (padded to 4), each batch a new shape and the rows' cost at its worst.
        # Only a bundle's last batch is short, padded by _padded.
        return {'min_batch_size': self.max_batch_size, 'max_batch_size': self.max_batch_size}

    def run_inference(self, batch: Sequence[dict], model: Loaded, inference_args=None) -> Iterable[dict]:
        if self.task == 'generate':
            return self._generate(batch, model.model, model.encoder)
        return self._score(batch, model.model)

    def _generate(self, batch, model, encoder):
        from .sample import sample_sequence

        rows = _padded([element['ids'] for element in batch])
        seeds = _padded([element_seed(self.seed, element['key']) for element in batch])
        out = sample_sequence(model, self.length, context=rows, seed=np.array(seeds, np.int64), **self.options)
        results = []
        for element, row in zip(batch, out):
            new = [int(t) for t in row[len(element['ids']):]]
            results.append({'key': element['key'], 'tokens': new, 'text': encoder.decode(new)})
        return results

    def _score(self, batch, model):
        from .scoring import score, window_log_probs

        n_ctx = model.hparams.n_ctx
        short = [i for i, element in enumerate(batch) if len(element['ids']) <= n_ctx]  # by place: keys may repeat
        scored = {}
        if short:
            scored.update(zip(short, score(model, _padded([batch[i]['ids'] for i in short]))))
        for i, element in enumerate(batch):
            if i not in scored:
                scored[i] = window_log_probs(model, element['ids'], stride=self.stride)
        return [{'key': e['key'], 'log_probs': [float(x) for x in scored[i]],
                 'nll': float(-np.mean(scored[i], dtype=np.float64)), 'tokens': int(len(scored[i]))}
                for i, e in enumerate(batch)]


class Tokenize(beam.DoFn):
    """(key, text, error) -> {'key', 'ids'}, or an error record (tagged 'errors') for a line that could not be
    read or what the model cannot take."""

    def __init__(self, model_dir: str, task: str, length: int):
        self.model_dir, self.task, self.length = model_dir, task, length

    def setup(self):
        from .encoder import encoder_for

        folder = local_folder(self.model_dir)
        self.encoder = encoder_for(folder)
        self.hparams = resolve(folder).hparams()

    def process(self, element):
        key, text, error = element
        if error is not None:
            yield beam.pvalue.TaggedOutput('errors', {'key': key, 'error': error})
            return
        ids = self.encoder.encode(text)
        try:
            self.check(ids)
        except validate.GPT2Error as e:
            yield beam.pvalue.TaggedOutput('errors', {'key': key, 'error': str(e)})
        else:
            yield {'key': key, 'ids': ids}

    def check(self, ids: list) -> None:
        """Raises GPT2Error for token ids the task cannot take."""
        validate.check_token_ids(ids, self.hparams.n_vocab)
        if self.task == 'score' and len(ids) < 2:
            raise validate.GPT2Error(f'{len(ids)} token(s): scoring needs 2')
        if self.task == 'generate':
            if not ids:
                raise validate.GPT2Error('empty prompt')
            validate.check_window(len(ids), self.length, self.hparams.n_ctx)


def _lines(readable) -> Iterable:
    """A matched file -> (key, text, error) per record: file:line for text, the `key` field for JSONL. Lines end
    at \\n alone (a \\r before it dropped); a line that cannot be read (not UTF-8, not a JSON object with a
    string `text`) has an error instead of a text."""
    path = readable.metadata.path
    jsonl = path.endswith(('.jsonl', '.json'))
    lines = readable.read().split(b'\n')
    for number, raw in enumerate(lines[:-1] if lines[-1] == b'' else lines, start=1):
        key = f'{path}:{number}'
        try:
            line = raw.removesuffix(b'\r').decode('utf-8')
        except UnicodeDecodeError as e:
            yield key, None, f'not UTF-8 text ({e.reason} at byte {e.start} of the line)'
            continue
        if not jsonl:
            yield key, line, None
        elif line.strip():
            yield _record(key, line)


def _record(key: str, line: str) -> tuple:
    """A JSONL line -> (key, text, error)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return key, None, f'not JSON: {e.msg} at column {e.colno}'
    if not isinstance(record, dict):
        return key, None, f'not a JSON object but {type(record).__name__}: give {{"key": ..., "text": ...}}'
    key = key if record.get('key') is None else str(record['key'])
    if not isinstance(record.get('text'), str):
        return key, None, f'"text" must be a string, got {json.dumps(record.get("text"))}'
    return key, record['text'], None


def pipeline(p, *, task: str, model_dir: str, input_glob: str, output: str, handler: GPT2ModelHandler):
    """The named transforms, from files to JSONL records."""
    tokenized = (p
                 | 'Read' >> (fileio.MatchFiles(input_glob) | fileio.ReadMatches() | beam.FlatMap(_lines))
                 | 'Tokenize' >> beam.ParDo(Tokenize(handler.model_dir, task, handler.length)).with_outputs(
                     'errors', main='ok'))
    results = tokenized.ok | 'RunInference' >> RunInference(handler)
    return ((results, tokenized.errors) | 'Merge' >> beam.Flatten()
            | 'Format' >> beam.Map(json.dumps)
            | 'Write' >> beam.io.WriteToText(output, file_name_suffix='.jsonl'))


# --- encode: text files to one token file ------------------------------------------------------------

def _encoder(model_dir: Optional[str]):
    """The encoder of corpus.vocabulary_of(model_dir): the folder's own vocabulary, else a one-line refusal."""
    folder = None if model_dir is None else local_folder(model_dir)
    try:
        return corpus.encoder_of(folder)
    except validate.GPT2Error as e:
        if folder == model_dir:
            raise
        raise validate.GPT2Error(str(e).replace(folder, model_dir)) from None  # named as given, not as copied


def text_files(inputs: Sequence[str], glob: str = '*.txt') -> list:
    """The files, in encode_corpus's order: local files and folders as corpus.documents finds them,
    anything else (gs://..., a pattern) through Beam's file systems, sorted."""
    found = []
    for item in inputs:
        if item == '-':
            raise validate.GPT2Error('a pipeline reads files, not standard input: give files, folders or globs')
        if os.path.exists(item):
            found += corpus.documents([item], glob=glob)
            continue
        paths = matched(item)
        if not paths:
            raise validate.GPT2Error(f'{item}: no files match it; give text files, folders or globs')
        found += paths
    return found


class EncodeFile(beam.DoFn):
    """(index, path) -> (index, shard, tokens, documents): the ids of the file's documents, each followed by
    <|endoftext|> (corpus.pieces), written to shards/index."""

    def __init__(self, model_dir: Optional[str], shards: str, piece: int):
        self.model_dir, self.shards, self.piece = model_dir, shards, piece

    def setup(self):
        self.encoder = _encoder(self.model_dir)
        self.dtype = corpus.dtype_for(self.encoder.n_vocab)

    def process(self, element):
        index, path = element
        shard, tokens, documents = f'{self.shards}/{index:09d}.bin', 0, 0
        end = np.asarray([self.encoder.encoder['<|endoftext|>']], self.dtype)
        raw = CompressionTypes.UNCOMPRESSED
        with FileSystems.create(shard, compression_type=raw) as out:
            opener = functools.partial(FileSystems.open, path, compression_type=raw)
            for piece in corpus.file_pieces(path, self.piece, opener=opener):  # as encode_corpus reads it
                ids = end if piece is None else corpus.ids_of(self.encoder, piece)
                out.write(ids.tobytes())
                tokens, documents = tokens + ids.size, documents + (piece is None)
        yield index, shard, tokens, documents


def join_shards(shards: list, *, output: str, model_dir: Optional[str], inputs: Sequence = ()) -> dict:
    """Concatenates the shards in index order into output.partial, writes the sidecar, renames both into
    place (as encode_corpus does) and removes the shards; returns the sidecar. Inputs without text are
    refused, as encode_corpus refuses them."""
    shards = sorted(shards)
    if shards and not any(FileSystems.exists(shard) for _, shard, _, _ in shards):
        # The step retried (a runner may) after it had finished: the shards go only once the output is in place.
        with FileSystems.open(output + corpus.SIDECAR) as f:
            return json.loads(f.read().decode('utf-8'))
    encoder = _encoder(model_dir)
    corpus.check_text(sum(t for _, _, t, _ in shards), inputs)
    partial = output + '.partial'
    with FileSystems.create(partial) as out:
        for _, shard, _, _ in shards:
            with FileSystems.open(shard) as f:
                while block := f.read(1 << 24):
                    out.write(block)
    sidecar = corpus.sidecar_of(encoder, sum(t for _, _, t, _ in shards), sum(d for _, _, _, d in shards))
    with FileSystems.create(output + corpus.SIDECAR + '.partial') as f:
        f.write((json.dumps(sidecar, indent=2) + '\n').encode('utf-8'))
    FileSystems.rename([partial, output + corpus.SIDECAR + '.partial'], [output, output + corpus.SIDECAR])
    FileSystems.delete([shard for _, shard, _, _ in shards])
    return sidecar


def encode_pipeline(p, files: list, *, output: str, model_dir: Optional[str] = None, piece: int = corpus.PIECE):
    """The named transforms of encode: Files, Encode (one element a file, in parallel), Join (in order)."""
    shards = output + '.partial.shards'
    return (p
            | 'Files' >> beam.Create(list(enumerate(files)))
            | 'Reshuffle' >> beam.Reshuffle()  # spread the files over the workers
            | 'Encode' >> beam.ParDo(EncodeFile(model_dir, shards, piece))
            | 'Gather' >> beam.combiners.ToList()
            | 'Join' >> beam.Map(join_shards, output=output, model_dir=model_dir, inputs=files))


def encode_main(args, beam_args) -> int:
    """python -m gpt2_tf.beam encode: the files first (errors before any pipeline), then the pipeline."""
    if not args.output.endswith('.bin'):
        raise validate.GPT2Error(f'{args.output}: the output of encode is a token file: OUT.bin')
    files = text_files(args.input, args.glob)
    _encoder(args.model_dir)  # a vocabulary that cannot be read fails here, not on a worker
    try:
        with unlogged_step_errors(), beam.Pipeline(options=PipelineOptions(beam_args)) as p:
            encode_pipeline(p, files, output=args.output, model_dir=args.model_dir)
    finally:
        _remove_shards(args.output)
    return 0


@contextlib.contextmanager
def unlogged_step_errors():
    """Beam logs a failed step's exception with its traceback, then raises it: main reports a GPT2Error (a file
    that is not UTF-8) in one line, and any other goes up with its own traceback, so the log is left out."""
    import logging

    logger = logging.getLogger('apache_beam.runners.common')
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _remove_shards(output: str) -> None:
    import shutil

    if os.path.isdir(output + '.partial.shards'):
        shutil.rmtree(output + '.partial.shards', ignore_errors=True)
    for leftover in (output + '.partial', output + corpus.SIDECAR + '.partial'):
        if os.path.exists(leftover):
            os.remove(leftover)


def local_threads(options: PipelineOptions) -> Optional[int]:
    """TensorFlow's threads per worker when the DirectRunner runs several worker processes on this machine:
    its cores shared out (each worker's TensorFlow would otherwise start a thread per core, and they fight
    over the cores); None for other runners, whose workers have machines of their own."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    runner = options.view_as(StandardOptions).runner
    direct = options.view_as(DirectOptions)
    if runner not in (None, 'DirectRunner') or direct.direct_running_mode != 'multi_processing':
        return None
    workers = direct.direct_num_workers or corpus.default_processes()  # 0: one a core
    return max(1, corpus.default_processes() // workers)


FOR_TASK = {'length': 'generate', 'temperature': 'generate', 'top_k': 'generate', 'top_p': 'generate',
            'seed': 'generate', 'stride': 'score', 'glob': 'encode'}  # the options one task reads


def check_arguments(parser, args, beam_args: list) -> None:
    """Refuses a misspelling of this command's own options (Beam would drop it with a warning among its
    others, and the job would run with the default) and an option its task does not read."""
    import difflib

    ours = [flag for action in parser._actions for flag in action.option_strings if flag.startswith('--')]
    for word in beam_args:
        flag = word.split('=', 1)[0]
        close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.7) if flag.startswith('--') else []
        if close:  # none of Beam's own options is this close to one of ours
            raise validate.GPT2Error(f'unrecognized {flag} (did you mean {close[0]}?)')
    for name, task in FOR_TASK.items():
        if args.task != task and getattr(args, name) != parser.get_default(name):
            raise validate.GPT2Error(f'--{name} is for {task}; {args.task} does not read it')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gpt2_tf.beam', description=__doc__.splitlines()[0])
    parser.add_argument('task', choices=TASKS)
    parser.add_argument('--model_dir', help='the model (score, generate); encode: its vocabulary (default GPT-2\'s)')
    parser.add_argument('--input', required=True, nargs='+',
                        help='a file or glob: text lines, or .jsonl with key and text; encode: text files, folders '
                             'or globs')
    parser.add_argument('--output', required=True, help='the output prefix (sharded .jsonl files); encode: OUT.bin')
    parser.add_argument('--glob', default='*.txt', help="encode: the files taken from folders (default: '*.txt')")
    parser.add_argument('--length', type=int, default=40, help='generate: new tokens per element')
    parser.add_argument('--temperature', type=float, default=1.0)
    parser.add_argument('--top_k', type=int, default=0)
    parser.add_argument('--top_p', type=float, default=1.0)
    parser.add_argument('--seed', type=int, default=0, help="the pipeline's seed; each element's derives from it")
    parser.add_argument('--stride', type=int, default=None, help='score: the window stride (default n_ctx // 2)')
    args, beam_args = parser.parse_known_args(argv)
    try:
        check_arguments(parser, args, beam_args)
        if args.task == 'encode':
            return encode_main(args, beam_args)
        if args.model_dir is None or len(args.input) != 1:
            raise validate.GPT2Error(f'{args.task} takes --model_dir and one --input (a file or glob)')
        if not matched(args.input[0]):
            raise validate.GPT2Error(f'{args.input[0]}: no files match it; give a file or glob')
        handler = GPT2ModelHandler(args.model_dir, args.task, length=args.length, temperature=args.temperature,
                                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stride=args.stride,
                                   threads=local_threads(PipelineOptions(beam_args)))
    except validate.GPT2Error as e:
        print(f'gpt2_tf.beam: error: {e}', file=sys.stderr)
        return 2
    with beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        pipeline(p, task=args.task, model_dir=args.model_dir, input_glob=args.input[0], output=args.output,
                 handler=handler)
    return 0


if __name__ == '__main__':  # the pipeline's parts are gpt2_tf.beam's, which workers import, not this __main__'s
    from gpt2_tf.beam import main as beam_main

    sys.exit(beam_main())
