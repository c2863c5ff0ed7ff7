"""Batch inference with Apache Beam: a ModelHandler for RunInference, and a ready pipeline.

    python -m gpt2_tf.beam score    --model_dir D --input 'texts/*.txt' --output out/scores [beam options]
    python -m gpt2_tf.beam generate --model_dir D --input prompts.jsonl --output out/samples --length 40

Input is text lines (key = file:line) or JSONL objects with `key` and `text`;
output is JSONL, one record per input with its key and the result (`text` and
`tokens` for generate; `log_probs`, `nll`, `tokens` for score) or an `error`.
The pipeline is a few named transforms: Read, Tokenize (bad inputs become
error records here, never a failed pipeline), RunInference, Format, Write.

Element seeds derive from the pipeline's seed and the element's key, so a
result does not depend on how Beam batches; batches are padded to 1, 2, 4 or 8
rows so that workers compile a few shapes. Inputs are checked by the library's
rules (validate.py): options when the handler is made, each element's window
and token ids in Tokenize. Needs the beam extra: pip install -e '.[beam]'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any, Dict, Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np
from apache_beam.io import fileio
from apache_beam.ml.inference.base import ModelHandler, RunInference
from apache_beam.options.pipeline_options import PipelineOptions

from . import validate

# Rows per model call; a batch is padded up to the next of these. Rows pad by powers of two, not by
# compiled.bucket (8, 16, 32, ...: for sequence lengths, where 8 is small): a lone element would cost 8 rows.
BATCH_SIZES = (1, 2, 4, 8)
TASKS = ('score', 'generate')


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
                 top_p: float = 1.0, seed: int = 0, stride: Optional[int] = None, max_batch_size: int = 8):
        if task not in TASKS:
            raise validate.GPT2Error(f'task must be one of {TASKS}, got {task!r}')
        validate.check_sampling(temperature, top_k, top_p, 1)
        if task == 'generate':
            from .hparams import HParams

            validate.check_length(length, HParams.from_json(f'{model_dir}/hparams.json').n_ctx)
        self.model_dir, self.task, self.length, self.seed, self.stride = model_dir, task, length, seed, stride
        self.options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.max_batch_size = min(max_batch_size, BATCH_SIZES[-1])

    def load_model(self):
        from . import quiet

        quiet.tensorflow()
        from .loading import load_model
        from .encoder import encoder_for

        return Loaded(load_model(self.model_dir), encoder_for(self.model_dir))

    def batch_elements_kwargs(self) -> Dict[str, Any]:
        return {'min_batch_size': 1, 'max_batch_size': self.max_batch_size}

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
        short = [element for element in batch if len(element['ids']) <= n_ctx]
        scored = {}
        if short:
            rows = _padded([element['ids'] for element in short])
            for element, lp in zip(short, score(model, rows)):
                scored[element['key']] = lp
        for element in batch:
            if element['key'] not in scored:
                scored[element['key']] = window_log_probs(model, element['ids'], stride=self.stride or n_ctx // 2)
        return [{'key': e['key'], 'log_probs': [float(x) for x in scored[e['key']]],
                 'nll': float(-np.mean(scored[e['key']], dtype=np.float64)), 'tokens': int(len(scored[e['key']]))}
                for e in batch]


class Tokenize(beam.DoFn):
    """(key, text) -> {'key', 'ids'}, or an error record (tagged 'errors') for what the model cannot take."""

    def __init__(self, model_dir: str, task: str, length: int):
        self.model_dir, self.task, self.length = model_dir, task, length

    def setup(self):
        from .encoder import encoder_for
        from .hparams import HParams

        self.encoder = encoder_for(self.model_dir)
        self.hparams = HParams.from_json(f'{self.model_dir}/hparams.json')

    def process(self, element):
        key, text = element
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
    """A matched file -> (key, text) per record: file:line for text, the `key` field for JSONL."""
    path = readable.metadata.path
    jsonl = path.endswith(('.jsonl', '.json'))
    for number, line in enumerate(readable.read_utf8().splitlines(), start=1):
        if jsonl:
            if not line.strip():
                continue
            record = json.loads(line)
            yield str(record.get('key', f'{path}:{number}')), str(record.get('text', ''))
        else:
            yield f'{path}:{number}', line


def pipeline(p, *, task: str, model_dir: str, input_glob: str, output: str, handler: GPT2ModelHandler):
    """The named transforms, from files to JSONL records."""
    tokenized = (p
                 | 'Read' >> (fileio.MatchFiles(input_glob) | fileio.ReadMatches() | beam.FlatMap(_lines))
                 | 'Tokenize' >> beam.ParDo(Tokenize(model_dir, task, handler.length)).with_outputs(
                     'errors', main='ok'))
    results = tokenized.ok | 'RunInference' >> RunInference(handler)
    return ((results, tokenized.errors) | 'Merge' >> beam.Flatten()
            | 'Format' >> beam.Map(json.dumps)
            | 'Write' >> beam.io.WriteToText(output, file_name_suffix='.jsonl'))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gpt2_tf.beam', description=__doc__.splitlines()[0])
    parser.add_argument('task', choices=TASKS)
    parser.add_argument('--model_dir', required=True)
    parser.add_argument('--input', required=True, help='a file or glob: text lines, or .jsonl with key and text')
    parser.add_argument('--output', required=True, help='the output prefix (sharded .jsonl files)')
    parser.add_argument('--length', type=int, default=40, help='generate: new tokens per element')
    parser.add_argument('--temperature', type=float, default=1.0)
    parser.add_argument('--top_k', type=int, default=0)
    parser.add_argument('--top_p', type=float, default=1.0)
    parser.add_argument('--seed', type=int, default=0, help="the pipeline's seed; each element's derives from it")
    parser.add_argument('--stride', type=int, default=None, help='score: the window stride (default n_ctx // 2)')
    args, beam_args = parser.parse_known_args(argv)
    try:
        handler = GPT2ModelHandler(args.model_dir, args.task, length=args.length, temperature=args.temperature,
                                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stride=args.stride)
    except validate.GPT2Error as e:
        print(f'gpt2_tf.beam: error: {e}', file=sys.stderr)
        return 2
    with beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        pipeline(p, task=args.task, model_dir=args.model_dir, input_glob=args.input, output=args.output,
                 handler=handler)
    return 0


if __name__ == '__main__':
    sys.exit(main())
