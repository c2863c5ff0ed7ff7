"""Test and benchmark tooling: original-format checkpoints with random values, chi-square fits.

bench/ imports this module too (it puts tests/ on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from gpt2_tf import compiled
from gpt2_tf.hparams import HParams
from gpt2_tf.tf1_reference import gpt2_graph

v1 = tf.compat.v1


def attention64(q, k, v):
    """The original attention, in float64: scores over sqrt(f), the -1e10 mask, softmax, the values."""
    q, k, v = (tf.cast(t, tf.float64) for t in (q, k, v))
    nd, ns = q.shape[2], k.shape[2]
    w = tf.matmul(q, k, transpose_b=True) / np.sqrt(q.shape[-1])
    seen = tf.constant(np.arange(nd)[:, None] >= np.arange(ns)[None] - ns + nd, tf.float64)
    return tf.matmul(tf.nn.softmax(w * seen - 1e10 * (1 - seen)), v)


def with_gradients(attend, q, k, v, grad):
    """attend(q, k, v) and [q's, k's, v's gradients] for the output's gradient grad (cast to its dtype)."""
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out = attend(q, k, v)
    return out, tape.gradient(out, [q, k, v], output_gradients=tf.cast(grad, out.dtype))


def write_random_checkpoint(model_dir: str | os.PathLike, hparams: HParams, *, seed: int = 0,
                            scale: float = 0.05, meta_graph: bool = True) -> str:
    """Writes an original-format checkpoint with random values through tf.compat.v1.train.Saver.

    Every value is non-trivial: gains are 1 + noise, biases are noise, so a port
    that drops a gain or a bias fails. Returns the checkpoint prefix.
    """
    model_dir = os.fspath(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    graph = tf.Graph()
    with graph.as_default():
        tokens = v1.placeholder(tf.int32, [None, None])
        gpt2_graph(hparams, tokens)
        variables = v1.global_variables()
        saver = v1.train.Saver(var_list=variables, save_relative_paths=True)
        with v1.Session(graph=graph) as session:
            values = {}
            for variable in variables:
                shape = variable.shape.as_list()
                value = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
                if variable.op.name.endswith('/g'):
                    value += 1
                values[variable.initializer.inputs[1]] = value
            # One run for every variable: each run of a large graph costs a fraction of a second by itself.
            session.run([variable.initializer for variable in variables], feed_dict=values)
            prefix = saver.save(session, os.path.join(model_dir, 'model.ckpt'), write_meta_graph=meta_graph)
    hparams.to_json(os.path.join(model_dir, 'hparams.json'))
    return prefix


def write_vocabulary(folder: str | os.PathLike, n_vocab: int) -> tuple:
    """GPT-2's first n_vocab tokens as a vocabulary pair in folder: (encoder.json, vocab.bpe) paths. GPT-2's
    ids 0..255 are its bytes and id 256 + r is merge r's token, so those tokens and the first n_vocab - 256
    merges are a whole vocabulary, written here from the bundled files without the encoder's code."""
    from gpt2_tf.assets import bundled_vocabulary

    encoder_path, bpe_path = bundled_vocabulary()
    with open(encoder_path, encoding='utf-8') as f:
        tokens = {token: i for token, i in json.load(f).items() if i < n_vocab}
    with open(bpe_path, encoding='utf-8') as f:
        lines = f.read().split('\n')
    os.makedirs(folder, exist_ok=True)
    paths = os.path.join(folder, 'encoder.json'), os.path.join(folder, 'vocab.bpe')
    with open(paths[0], 'w', encoding='utf-8') as f:
        json.dump(tokens, f)
    with open(paths[1], 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines[:1 + n_vocab - 256]) + '\n')  # the #version line, then the merges
    return paths


def chi_square_p_value(counts, expected, *, merge_below: float = 5.0) -> tuple:
    """Goodness of fit of observed counts to expected counts (same total): (statistic, df, p-value).

    Bins expected fewer than merge_below times are merged into one bin, as the
    test requires. The p-value uses the Wilson-Hilferty approximation of the
    chi-square distribution, accurate to a few percent in the tail for df >= 3.
    """
    counts, expected = np.asarray(counts, np.float64), np.asarray(expected, np.float64)
    small = expected < merge_below
    observed = np.append(counts[~small], counts[small].sum())
    wanted = np.append(expected[~small], expected[small].sum())
    if wanted[-1] == 0:
        assert observed[-1] == 0, f'{observed[-1]:.0f} draws fell where nothing was expected'
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(wanted) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return statistic, df, 0.5 * math.erfc(z / math.sqrt(2))


def compiled_hlo(shared, model, *args, **static) -> str:
    """The HLO that XLA compiles for this call: an argument that it needs as a constant shows as its value."""
    shared(model, *args, **static)  # traced
    shared._model.value = model
    try:
        return shared._compiled.experimental_get_compiler_ir(compiled.weights(model), *args, **static)(stage='hlo')
    finally:
        shared._model.value = None


class FakeModel(tf.Module):
    """A model shape without weights: what the loop, the slots and compiled.shared read of a model."""

    dtype = 'float32'

    def __init__(self, n_vocab: int, n_ctx: int):
        super().__init__()
        self.hparams = HParams(n_vocab=n_vocab, n_ctx=n_ctx, n_embd=4, n_head=1, n_layer=1)

    def on_device(self):
        return tf.device('/CPU:0')


def ended_pid() -> int:
    """The pid of a process that has ended: no live process holds it (until the system hands it out again)."""
    return int(subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                              text=True, check=True).stdout)


def no_cache(model, batch, size):
    return []


@contextlib.contextmanager
def running(app):
    """Serves the app on a free port of 127.0.0.1 in a thread; yields the port."""
    import uvicorn

    from gpt2_tf.serve import bind

    sock = bind('127.0.0.1', 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level='warning'))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
