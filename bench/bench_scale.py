"""The cost of scaling out, on one machine: the Beam pipeline against a plain loop, and MirroredStrategy
over 2 logical CPU devices against one device.

    python bench/bench_scale.py [--lines 200] [--prompts 48] [--length 20] [--rounds 2] [--parts beam,mirrored]

Both use the 124M-shaped random checkpoint (bench/.cache/). Each side is a
fresh process timed from its start to its last result (imports and model load
included on both sides): `python -m gpt2_tf.beam score|generate` on the
DirectRunner (in one process, and with 2 worker processes), and a plain loop
that scores the same lines, or samples the same prompts with the same per-key
seeds, in batches of 8 through the library. The sides run interleaved, round
after round, so that a busy machine slows them alike; the table gives each
side's best round.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

MIRRORED = '''
import json, sys, time
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np, gpt2_tf
from gpt2_tf.distribute import make_strategy
from gpt2_tf.train import Trainer
folder, steps, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokens = np.random.default_rng(0).integers(0, 50257, (2, length)).astype(np.int32)
out = {}
for name, strategy in (('one device', None), ('MirroredStrategy, 2 logical CPUs', make_strategy('mirrored'))):
    trainer = Trainer(gpt2_tf.load_model(folder, strategy=strategy), 1e-4)
    trainer.step(tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter(); trainer.step(tokens); times.append(time.perf_counter() - start)
    out[name] = sorted(times)[len(times) // 2]
print(json.dumps(out))
'''


LOOP = '''
import json, sys, time
start = time.perf_counter()
import numpy as np
import gpt2_tf
from gpt2_tf.beam import element_seed
folder, task, path, length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = gpt2_tf.load_model(folder)
lines = open(path).read().splitlines()
rows = [gpt2_tf.encode(line) for line in lines]
tokens = 0
for at in range(0, len(rows), 8):
    if task == 'score':
        tokens += sum(len(lp) for lp in gpt2_tf.score(model, rows[at:at + 8]))
    else:
        seeds = np.array([element_seed(0, f'{path}:{n + 1}') for n in range(at, min(at + 8, len(rows)))], np.int64)
        gpt2_tf.sample_sequence(model, length, context=rows[at:at + 8], seed=seeds, top_k=40)
        tokens += length * len(seeds)
print(json.dumps({'seconds': time.perf_counter() - start, 'tokens': tokens}))
'''


def beam_side(folder, task, path, length, out, workers):
    start = time.perf_counter()
    mode = ['--direct_running_mode', 'multi_processing', '--direct_num_workers', str(workers)] if workers > 1 else \
        ['--direct_running_mode', 'in_memory']
    subprocess.run([sys.executable, '-m', 'gpt2_tf.beam', task, '--model_dir', folder, '--input', str(path),
                    '--output', str(out), '--length', str(length), '--top_k', '40', *mode], check=True,
                   capture_output=True)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for f in out.parent.glob(out.name + '*.jsonl') for line in open(f)]
    for f in out.parent.glob(out.name + '*.jsonl'):
        f.unlink()
    counts = [r['tokens'] if task == 'score' else len(r['tokens']) for r in records]
    return {'seconds': seconds, 'tokens': sum(counts)}


def loop_side(folder, task, path, length):
    done = subprocess.run([sys.executable, '-c', LOOP, folder, task, str(path), str(length)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_beam(folder, args) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    words = 'the a cat dog sat ran on under mat log and then quietly very far home'.split()
    sides = {'plain loop, one process': lambda *a: loop_side(*a[:4]),
             'Beam, DirectRunner, in one process': lambda *a: beam_side(*a, 1),
             'Beam, DirectRunner, 2 worker processes': lambda *a: beam_side(*a, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        for task, count, words_per_line in (('score', args.lines, 60), ('generate', args.prompts, 20)):
            path = pathlib.Path(tmp) / f'{task}.txt'
            path.write_text('\n'.join(' '.join(rng.choice(words, words_per_line)) for _ in range(count)) + '\n')
            best = {}
            for _ in range(args.rounds):
                for name, side in sides.items():
                    result = side(folder, task, path, args.length, pathlib.Path(tmp) / 'out')
                    if name not in best or result['seconds'] < best[name]['seconds']:
                        best[name] = result
            base = best['plain loop, one process']
            what = (f'{count} lines scored' if task == 'score'
                    else f'{count} prompts, {args.length} new tokens each, top_k 40')
            print(f'{task}: {what}, best of {args.rounds} interleaved rounds')
            for name, result in best.items():
                speed = result['tokens'] / result['seconds']
                print(f'  {name:<40} {result["seconds"]:7.1f} s  {speed:8.1f} tokens/s  '
                      f'{speed / (base["tokens"] / base["seconds"]):5.2f}x  ({result["tokens"]:,} tokens)')


def compare_mirrored(folder, args) -> None:
    done = subprocess.run([sys.executable, '-c', MIRRORED, folder, str(args.steps), str(args.train_length)],
                          capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    result = json.loads(done.stdout.splitlines()[-1])
    base = result['one device']
    print(f'training step, batch 2, T = {args.train_length}, Adam (median of {args.steps}):')
    for name, seconds in result.items():
        print(f'  {name:<34} {seconds:6.2f} s  ({seconds / base - 1:+.0%})')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--lines', type=int, default=200, help='score: lines of 60 words')
    parser.add_argument('--prompts', type=int, default=48, help='generate: prompts of 20 words')
    parser.add_argument('--length', type=int, default=20, help='generate: new tokens per prompt')
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--parts', default='beam,mirrored')
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--train_length', type=int, default=256, help='tokens per row of the training batch (2 rows)')
    args = parser.parse_args()
    from bench_generate import checkpoint, cpu

    folder = str(checkpoint())
    print(f'CPU: {cpu()}')
    if 'beam' in args.parts:
        compare_beam(folder, args)
    if 'mirrored' in args.parts:
        compare_mirrored(folder, args)


if __name__ == '__main__':
    main()
