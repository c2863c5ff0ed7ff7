"""Process start to first token, and peak memory of generation, against the TF1 reference in fresh processes.

    python bench/bench_startup.py startup [--model 124M]
    python bench/bench_startup.py memory  [--model 1558M]

startup: `gpt2-tf generate` for one token, from process start to exit, with
the persistent XLA cache empty (first run) and filled (second run), against a
fresh process that builds the TF1 reference sampler and draws one token.

memory: the peak RSS (VmHWM) of a fresh process that loads the model and
generates 64 tokens after a 16-token prompt at batch 1, in float32 and
bfloat16, against the TF1 reference doing the same. The random checkpoint of
the model's shape is written once, tensor by tensor, to
~/.cache/gpt2_tf/bench/ (outside the repository).
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))

CACHE = pathlib.Path(os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache') / 'gpt2_tf' / 'bench'

TF1_ONE_TOKEN = '''
import sys, numpy as np
from gpt2_tf import HParams
from gpt2_tf.tf1_reference import Reference
folder = sys.argv[1]
reference = Reference(HParams.from_json(folder + '/hparams.json'), folder + '/model.ckpt')
print(reference.sampler(length=int(sys.argv[2]), batch_size=1, top_k=1, top_p=None)(np.arange(16)[None] + 100))
with open('/proc/self/status') as f:
    print(next(line for line in f if line.startswith('VmHWM')))
'''

OURS = '''
import sys, numpy as np, gpt2_tf
model = gpt2_tf.load_model(sys.argv[1], dtype=sys.argv[3])
print(gpt2_tf.sample_sequence(model, int(sys.argv[2]), context=np.arange(16) + 100, top_k=1))
with open('/proc/self/status') as f:
    print(next(line for line in f if line.startswith('VmHWM')))
'''


def random_checkpoint(name: str) -> pathlib.Path:
    """The model's shape with random values, written one tensor at a time and merged into one bundle."""
    import numpy as np
    import tensorflow as tf

    from gpt2_tf import HParams
    from gpt2_tf.checkpoint import variable_shapes

    folder = CACHE / f'{name}-random'
    if (folder / 'checkpoint').exists():
        return folder
    hparams = HParams.named(name)
    staging = pathlib.Path(tempfile.mkdtemp(dir=CACHE.parent if CACHE.parent.exists() else None))
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prefixes = []
    print(f'writing a {name}-shaped random checkpoint to {folder} ...', flush=True)
    for i, (variable, shape) in enumerate(variable_shapes(hparams).items()):
        value = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if variable.endswith('/g'):
            value += 1
        prefix = str(staging / f'part-{i}')
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[variable], shape_and_slices=[''], tensors=[value])
        prefixes.append(prefix)
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=prefixes, destination_prefix=str(folder / 'model.ckpt'))
    shutil.rmtree(staging, ignore_errors=True)
    hparams.to_json(folder / 'hparams.json')
    (folder / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    return folder


def run(argv, env=None):
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    peak = next((int(line.split()[1]) / 1024 for line in done.stdout.splitlines() if line.startswith('VmHWM')), None)
    return seconds, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('what', choices=['startup', 'memory'])
    parser.add_argument('--model', default=None, help='124M for startup, 1558M for memory by default')
    args = parser.parse_args()
    from bench_generate import cpu

    print(f'CPU: {cpu()}')
    if args.what == 'startup':
        from bench_generate import checkpoint
        folder = str(checkpoint()) if (args.model or '124M') == '124M' else str(random_checkpoint(args.model))
        cache = tempfile.mkdtemp()
        env = dict(os.environ, GPT2_TF_XLA_CACHE=cache)
        ours = [sys.executable, '-m', 'gpt2_tf.cli', 'generate', 'Hello', '--model_dir', folder, '--length', '1',
                '--seed', '1', '--quiet']
        first, _ = run(ours, env)
        second, _ = run(ours, env)
        tf1, _ = run([sys.executable, '-c', TF1_ONE_TOKEN, folder, '1'])
        off, _ = run(ours, dict(env, GPT2_TF_XLA_CACHE='off'))
        shutil.rmtree(cache, ignore_errors=True)
        print(f'process start to first token ({folder}):')
        print(f'  gpt2-tf generate, XLA cache empty:  {first:6.1f} s')
        print(f'  gpt2-tf generate, XLA cache filled: {second:6.1f} s')
        print(f'  gpt2-tf generate, XLA cache off:    {off:6.1f} s')
        print(f'  TF1 reference sampler:              {tf1:6.1f} s')
        return
    folder = str(random_checkpoint(args.model or '1558M'))
    print(f'peak RSS, generating 64 tokens after 16 at batch 1 ({folder}), one process each:')
    for name, argv in (('TF1 reference, float32', [sys.executable, '-c', TF1_ONE_TOKEN, folder, '64']),
                       ('ours, float32', [sys.executable, '-c', OURS, folder, '64', 'float32']),
                       ('ours, bfloat16', [sys.executable, '-c', OURS, folder, '64', 'bfloat16'])):
        seconds, peak = run(argv, dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))
        print(f'  {name:<24} peak {peak:8.0f} MB   ({seconds:.0f} s)', flush=True)


if __name__ == '__main__':
    main()
