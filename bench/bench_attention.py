"""The causal attention of a sequence without a past: whole (the original's ops), in parts (gpt2_tf.causal), and
by the kernel's op (gpt2_tf.kernels.causal_attention, the default where it builds).

    python bench/bench_attention.py [--sections core,forward,train] [--reps 5]

core: the attention alone, 12 layers of 12 heads of 64 features, in a tf.function whose lengths are unknown
when traced (as the model's are), forward and forward + backward, at several batches and lengths.
forward: the 124M-shaped model's forward pass, one model tracing the whole attention and one the parts,
alternating in one process. train: a Trainer step (LoRA rank 8 on c_attn, and full Adam; recompute, batch 1,
T = 1024), the same way. Medians in ms (s for train), and each one's time over the whole's.
"""

import argparse
import os
import pathlib
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf import causal, kernels, model as graph  # noqa: E402
from gpt2_tf.train import Trainer  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402
from bench_int8 import alternating  # noqa: E402

WHOLE = 10 ** 9  # a PARTS_FROM no sequence reaches: the whole attention


def models(make) -> dict:
    """{'whole': make(), 'parts': make(), 'kernel': make()}, each built and traced under its PARTS_FROM, the first
    two inside kernels.tensorflow_ops() (the kernel's only where its library builds; float32 models' products
    take TensorFlow's ops outside decoding either way)."""
    built = {}
    for name, start in (('whole', WHOLE), ('parts', causal.PARTS_FROM), ('kernel', None)):
        if start is None:
            if kernels.attention_available():
                built[name] = make()
            continue
        before, causal.PARTS_FROM = causal.PARTS_FROM, start
        try:
            with kernels.tensorflow_ops():
                built[name] = make()
        finally:
            causal.PARTS_FROM = before
    return built


def against_whole(t: dict, unit: str = 'ms') -> str:
    """'whole 1.0 ms, parts 0.8 ms (0.80x), ...' from {name: seconds}."""
    scale = 1e3 if unit == 'ms' else 1
    return ', '.join(f'{name} {value * scale:.{0 if unit == "ms" else 2}f} {unit}' +
                     ('' if name == 'whole' else f' ({value / t["whole"]:.2f}x)') for name, value in t.items())


def core(reps: int) -> None:
    spec = [tf.TensorSpec([None, 12, None, 64], tf.float32)] * 3

    def attention(q, k, v):
        sequence = tf.shape(q)[2]
        mask = tf.reshape(graph.attention_mask(sequence, sequence, dtype=q.dtype), [1, 1, sequence, sequence])
        return tf.add_n([causal.causal_attn(q + i, k, v, mask, weights=graph.attention_weights,
                                             mask=graph.attention_mask) for i in range(12)])  # 12 layers, none shared

    def with_gradients(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v)
        return tape.gradient(out, [q, k, v])

    rng = np.random.default_rng(0)
    for batch, sequence in [(1, 1024), (1, 512), (2, 512), (1, 256), (8, 128)]:
        qkv = [tf.constant(rng.standard_normal((batch, 12, sequence, 64)), tf.float32) for _ in range(3)]
        # PARTS_FROM is read when traced: a function of its own for each, traced by its first call in models()
        def traced():
            pair = tf.function(attention, input_signature=spec), tf.function(with_gradients, input_signature=spec)
            for f in pair:
                f(*qkv)
            return pair

        functions = models(traced)
        timed = [alternating({name: lambda f=pair[i]: tf.nest.map_structure(np.asarray, f(*qkv))
                              for name, pair in functions.items()}, reps) for i in (0, 1)]
        print(f'core B{batch} T{sequence}: forward: {against_whole(timed[0])}; '
              f'with backward: {against_whole(timed[1])}', flush=True)


def forward(reps: int) -> None:
    shapes = [(1, 1024), (1, 512), (2, 512), (8, 128)]
    rng = np.random.default_rng(0)

    def make():
        model = gpt2_tf.load_model(checkpoint())
        for shape in shapes:
            model(np.zeros(shape, np.int32))  # traced here, under this PARTS_FROM
        return model

    built = models(make)
    for shape in shapes:
        tokens = rng.integers(0, 50257, shape).astype(np.int32)
        t = alternating({name: lambda m=m: m(tokens)['logits'].numpy() for name, m in built.items()}, reps)
        print(f'forward B{shape[0]} T{shape[1]}: {against_whole(t)}', flush=True)


def train(reps: int) -> None:
    tokens = np.random.default_rng(0).integers(0, 50257, (1, 1024)).astype(np.int32)
    for case, options in (('LoRA rank 8 on c_attn', dict(lora_rank=8, lora_targets='c_attn')), ('Adam', {})):
        def make():
            trainer = Trainer(gpt2_tf.load_model(checkpoint()), 1e-4, 'adam', 1, True, **options)
            trainer.step(tokens)  # traced here
            return trainer

        t = alternating({name: lambda tr=tr: tr.step(tokens) for name, tr in models(make).items()}, reps)
        print(f'train {case}, T 1024, recompute, a step: {against_whole(t, "s")}', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--sections', default='core,forward,train')
    parser.add_argument('--reps', type=int, default=5)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    sections = {'core': core, 'forward': forward, 'train': train}
    for name in args.sections.split(','):
        sections[name](args.reps)


if __name__ == '__main__':
    main()
