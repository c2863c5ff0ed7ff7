"""The cost of scaling out, on one machine: the Beam pipeline against a plain loop, and MirroredStrategy
over 2 logical CPU devices against one device.

    python bench/bench_scale.py [--lines 200] [--steps 3]

Both use the 124M-shaped random checkpoint (bench/.cache/). The Beam side is
`python -m gpt2_tf.beam score` on the DirectRunner with 2 worker processes,
timed from start to the last file written; the plain loop scores the same
lines with the same batches of 8 in one process (model load included).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--lines', type=int, default=200)
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--length', type=int, default=256, help='tokens per row of the training batch (2 rows)')
    args = parser.parse_args()
    import numpy as np

    from bench_generate import checkpoint, cpu
    folder = str(checkpoint())
    print(f'CPU: {cpu()}')
    rng = np.random.default_rng(0)
    words = 'the a cat dog sat ran on under mat log and then quietly very far home'.split()
    lines = [' '.join(rng.choice(words, 60)) for _ in range(args.lines)]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / 'lines.txt'
        path.write_text('\n'.join(lines) + '\n')
        start = time.perf_counter()
        subprocess.run([sys.executable, '-m', 'gpt2_tf.beam', 'score', '--model_dir', folder, '--input', str(path),
                        '--output', str(pathlib.Path(tmp) / 'out'), '--direct_running_mode', 'multi_processing',
                        '--direct_num_workers', '2'], check=True, capture_output=True)
        beam_seconds = time.perf_counter() - start
        scored = sum(json.loads(line)['tokens'] for f in pathlib.Path(tmp).glob('out*.jsonl') for line in open(f))
    start = time.perf_counter()
    import gpt2_tf
    from gpt2_tf.encoder import get_encoder
    model = gpt2_tf.load_model(folder)
    encoder = get_encoder()
    rows = [encoder.encode(line) for line in lines]
    for at in range(0, len(rows), 8):
        gpt2_tf.score(model, rows[at:at + 8])
    loop_seconds = time.perf_counter() - start
    print(f'{args.lines} lines, {scored:,} tokens scored')
    print(f'Beam, DirectRunner, 2 worker processes: {beam_seconds:7.1f} s  {scored / beam_seconds:8.1f} tokens/s')
    print(f'plain loop, one process:                {loop_seconds:7.1f} s  {scored / loop_seconds:8.1f} tokens/s')
    done = subprocess.run([sys.executable, '-c', MIRRORED, folder, str(args.steps), str(args.length)],
                          capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    result = json.loads(done.stdout.splitlines()[-1])
    base = result['one device']
    print(f'training step, batch 2, T = {args.length}, Adam (median of {args.steps}):')
    for name, seconds in result.items():
        print(f'  {name:<34} {seconds:6.2f} s  ({seconds / base - 1:+.0%})')


if __name__ == '__main__':
    main()
