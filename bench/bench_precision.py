"""Reduced precision: fidelity against the float32 TF1 graph, and speed, per dtype, in one run.

    python bench/bench_precision.py [--reps 3]

Fidelity on the two fixtures and on the 124M-shaped random checkpoint
(bench/.cache/): max |logit difference| relative to max |logit|, next-token
argmax agreement over all positions, and mean KL(float32 || reduced). Speed:
the forward pass (B=1 T=1024, B=8 T=128) and greedy decoding (16-token prompt
+ 64) in each dtype, against float32 and the TF1 graph, with the CPU's flags.
"""

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / 'tests'))

import numpy as np  # noqa: E402

import gpt2_tf  # noqa: E402
from gpt2_tf import HParams  # noqa: E402
from gpt2_tf.tf1_reference import Reference  # noqa: E402
from bench_generate import checkpoint, cpu  # noqa: E402
from test_precision import fidelity  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent.parent / 'tests' / 'fixtures'
DTYPES = ('float32', 'bfloat16', 'float16')


def timed(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=3)
    args = parser.parse_args()
    print(f'CPU: {cpu()}')
    folder = checkpoint()
    print(f'{"checkpoint":<16}{"dtype":<10}{"max|diff|/max|logit|":>22}{"argmax agree":>14}{"mean KL":>10}')
    rng = np.random.default_rng(0)
    cases = [(name, FIXTURES / name, np.load(FIXTURES / name / 'reference.npz')['tokens'])
             for name in ('tf1-tiny', 'tf1-tiny-hot')]
    cases.append(('124M-shaped', folder, rng.integers(0, 50257, (2, 256)).astype(np.int32)))
    for name, path, tokens in cases:
        reference = Reference(HParams.from_json(path / 'hparams.json'), str(path / 'model.ckpt'))(tokens)['logits']
        for dtype in DTYPES[1:]:
            diff, agree, kl = fidelity(gpt2_tf.load_model(path, dtype=dtype)(tokens)['logits'].numpy(), reference)
            print(f'{name:<16}{dtype:<10}{diff:>22.2e}{agree:>14.4f}{kl:>10.2e}', flush=True)
    hparams = HParams.named('124M')
    reference = Reference(hparams, str(folder / 'model.ckpt'))
    print(f'{"case":<30}{"TF1 ms":>9}' + ''.join(f'{d + " ms":>14}' for d in DTYPES) + '   (ours/TF1)')
    models = {dtype: gpt2_tf.load_model(folder, dtype=dtype) for dtype in DTYPES}
    for batch, length in ((1, 1024), (8, 128)):
        tokens = rng.integers(0, hparams.n_vocab, (batch, length)).astype(np.int32)
        tf1 = timed(lambda: reference(tokens), args.reps)
        ours = {d: timed(lambda: models[d](tokens)['logits'].numpy(), args.reps) for d in DTYPES}
        print(f'{f"forward B={batch} T={length}":<30}{tf1 * 1e3:>9.0f}' +
              ''.join(f'{ours[d] * 1e3:>8.0f} ({ours[d] / tf1:.2f})' for d in DTYPES), flush=True)
    for batch in (1, 8):
        prompt = rng.integers(0, hparams.n_vocab, (batch, 16)).astype(np.int32)
        sampler = reference.sampler(length=64, batch_size=batch, top_k=1, top_p=None)
        tf1 = timed(lambda: sampler(prompt), args.reps)
        ours = {d: timed(lambda: gpt2_tf.sample_sequence(models[d], 64, context=prompt, top_k=1), args.reps)
                for d in DTYPES}
        print(f'{f"greedy 16 + 64, B={batch}":<30}{tf1 * 1e3:>9.0f}' +
              ''.join(f'{ours[d] * 1e3:>8.0f} ({ours[d] / tf1:.2f})' for d in DTYPES), flush=True)


if __name__ == '__main__':
    main()
