"""On device: a LiteRT (TFLite) model with prefill and decode signatures over an external KV cache.

    export_litert(model, 'gpt2-litert')     # model.tflite, model.json, encoder.json, vocab.bpe

The signatures are the contract (one batch row; N is max_len, n_ctx by default):

    prefill(tokens int32 [1, T], input_pos int32 [T], kv_cache float32 [n_layer, 2, 1, n_head, N, head_size])
        -> {logits: float32 [1, n_vocab], kv_cache}     # the logits of the last of the T tokens
    decode(tokens int32 [1, 1], input_pos int32 [1], kv_cache) -> {logits: float32 [1, n_vocab], kv_cache}

input_pos holds consecutive positions (0 .. T - 1 for a prompt, then T, T + 1, ...
for each decoded token); their keys and values are written into those slots of
the cache, and each query sees the slots up to its own position, so the cache
needs no length argument. Both signatures run the library's cached step
(gpt2_tf.decoding.decode), so their logits are the model's. A model loaded with
dtype='int8' keeps its matrices and wte as int8 tensors in the file (float32 at
the signature boundary).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Optional

import tensorflow as tf

from . import kernels, validate
from .checkpoint import whole_folder
from .decoding import decode
from .encoder import END_OF_TEXT, carried_vocabulary
from .runtime import Model
from .validate import GPT2Error, check_litert, is_int

MODEL_FILE = 'model.tflite'
DESCRIPTION = 'model.json'


def cache_shape(model: Model, max_len: int) -> list:
    hp = model.hparams
    return [hp.n_layer, 2, 1, hp.n_head, max_len, hp.head_size]


class Signatures(tf.Module):
    """prefill and decode as tf.functions over one batch row and a cache of max_len slots."""

    def __init__(self, model: Model, max_len: int):
        super().__init__(name='gpt2_tf_litert')
        self.model = model
        self.max_len = max_len
        cache = tf.TensorSpec(cache_shape(model, max_len), tf.float32, name='kv_cache')
        spec = lambda shape, name: tf.TensorSpec(shape, tf.int32, name=name)  # noqa: E731
        # The converter names each signature after its function.
        self.prefill = tf.function(self.prefill, autograph=False,
                                   input_signature=[spec([1, None], 'tokens'), spec([None], 'input_pos'), cache])
        self.decode = tf.function(self.decode, autograph=False,
                                  input_signature=[spec([1, 1], 'tokens'), spec([1], 'input_pos'), cache])

    def prefill(self, tokens, input_pos, kv_cache):
        return self._step(tokens, input_pos, kv_cache)

    def decode(self, tokens, input_pos, kv_cache):
        return self._step(tokens, input_pos, kv_cache)

    def _step(self, tokens, input_pos, kv_cache):
        hp = self.model.hparams
        layer = [1, 2, hp.n_head, self.max_len, hp.head_size]  # a layer's [2, 1, ...] is [1, 2, ...] for one row
        caches = [tf.reshape(c, layer) for c in tf.unstack(kv_cache, axis=0)]
        logits, caches = decode(self.model, tokens, pads=tf.zeros([1], tf.int32), caches=caches, index=input_pos[0])
        kv_cache = tf.stack([tf.reshape(c, layer[1:2] + [1] + layer[2:]) for c in caches], axis=0)
        return {'logits': logits, 'kv_cache': tf.cast(kv_cache, tf.float32)}


def check_options(model: Model, dtype: str, max_len: Optional[int]) -> int:
    """max_len (n_ctx when None) after checking it and dtype (validate.check_litert), and dtype against the model."""
    max_len = check_litert(dtype, max_len, model.hparams.n_ctx)
    if dtype != model.dtype:
        raise GPT2Error(f'the model holds {model.dtype} weights but the export asks for {dtype}: '
                        f"load it with load_model(..., dtype='{dtype}') (--dtype {dtype})")
    return max_len


def describe(model: Model, max_len: int, *, dtype: str, vocabulary: tuple) -> dict:
    """model.json: the signatures, the cache and the vocabulary a runner needs (end_of_text: its id, when the
    vocabulary's encoder.json has <|endoftext|> among the model's ids)."""
    hp = model.hparams
    with open(vocabulary[0], encoding='utf-8') as f:
        end = json.load(f).get(END_OF_TEXT)
    words = {'encoder': 'encoder.json', 'bpe': 'vocab.bpe'}
    if is_int(end) and 0 <= end < hp.n_vocab:
        words['end_of_text'] = end
    cache = {'dtype': 'float32', 'shape': cache_shape(model, max_len),
             'layout': '[n_layer, 2 (keys, values), batch 1, n_head, max_len, head_size]'}
    return {
        'format': 'litert', 'dtype': dtype, 'max_len': max_len, 'hparams': hp.to_dict(),
        'signatures': {
            'prefill': {'inputs': {'tokens': {'dtype': 'int32', 'shape': [1, 'T']},
                                   'input_pos': {'dtype': 'int32', 'shape': ['T']}, 'kv_cache': cache},
                        'outputs': {'logits': {'dtype': 'float32', 'shape': [1, hp.n_vocab]}, 'kv_cache': cache}},
            'decode': {'inputs': {'tokens': {'dtype': 'int32', 'shape': [1, 1]},
                                  'input_pos': {'dtype': 'int32', 'shape': [1]}, 'kv_cache': cache},
                       'outputs': {'logits': {'dtype': 'float32', 'shape': [1, hp.n_vocab]}, 'kv_cache': cache}},
        },
        'input_pos': 'consecutive positions: 0 .. T - 1 for the prompt, then one more per decoded token',
        'vocabulary': words,
    }


def export_litert(model: Model, out_dir, *, dtype: Optional[str] = None, max_len: Optional[int] = None,
                  vocabulary: Optional[tuple] = None) -> dict:
    """Writes out_dir/model.tflite, model.json and the vocabulary files into out_dir (a new or empty folder,
    which appears only when complete); returns model.json's contents plus the conversion's seconds. dtype
    defaults to the model's own ('float32' or 'int8'); vocabulary, (encoder.json path, vocab.bpe path), to the
    model's own (encoder.carried_vocabulary: its folder's pair, else GPT-2's bundled one)."""
    dtype = dtype or model.dtype
    max_len = check_options(model, dtype, max_len)
    out_dir = validate.check_new_folder(out_dir)
    vocabulary = carried_vocabulary(model.folder.path if model.folder else None, model.hparams.n_vocab, vocabulary)
    start = time.perf_counter()
    signatures = Signatures(model, max_len)
    with kernels.tensorflow_ops():  # int8 as cast, scale and matmul: the converter keeps the weights int8
        functions = [signatures.prefill.get_concrete_function(), signatures.decode.get_concrete_function()]
    converter = tf.lite.TFLiteConverter.from_concrete_functions(functions, signatures)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]  # the plain runtime, no TF ops
    flatbuffer = converter.convert()
    description = describe(model, max_len, dtype=dtype, vocabulary=vocabulary)
    with whole_folder(out_dir) as staging:
        with open(os.path.join(staging, MODEL_FILE), 'wb') as f:
            f.write(flatbuffer)
        for source, name in zip(vocabulary, ('encoder.json', 'vocab.bpe')):
            shutil.copyfile(source, os.path.join(staging, name))
        with open(os.path.join(staging, DESCRIPTION), 'w', encoding='utf-8') as f:
            json.dump(description, f, indent=2)
            f.write('\n')
    return dict(description, seconds=time.perf_counter() - start, bytes=len(flatbuffer))
