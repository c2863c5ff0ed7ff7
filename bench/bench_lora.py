"""Fine-tuning memory and speed: LoRA (rank 8 on c_attn), Adafactor and Adam, each in a fresh process.

    python bench/bench_lora.py [--size 124M|1558M] [--length 1024] [--batch 1] [--steps 1] [--rounds 1] [--limit-gb 15]
                               [--cases lora,adam,...] [--no-recompute]

A random checkpoint of the size's shape is written once into bench/.cache/ (1558M tensor by tensor: each
tensor saved alone, then the bundles merged, so no more than one tensor is ever in memory). Every case
loads it, runs one step (tracing), then --steps timed steps (0: the first step's time is the step's), batch --batch, recompute=True
(--no-recompute: False, finetune's default, on every side). Peak memory is the
process's own VmHWM; a watchdog in this process kills a case whose RSS passes --limit-gb, and the table
says in which phase it stopped (the machine is never pushed into swap). Beside each step's wall time, the
process's CPU time for it: on a shared machine the load of others inflates the first more than the second. 'nograd' is the forward and the
backward through the activations alone, with the same recompute and no weight's gradient: what a LoRA step
needs at least, to which its time is compared. 'lora-int8' holds the frozen weights in int8 (their products
then run as TensorFlow ops, which widen each matrix to float32 as it is used). The cases run in turn, round after round, so that the
shared machine's load falls on every side alike.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, str(pathlib.Path(__file__).parent))
CACHE = pathlib.Path(__file__).parent / '.cache'

CASES = {
    'lora': 'LoRA rank 8 on c_attn, Adam on the adapters',
    'lora-int8': 'LoRA rank 8 on c_attn over int8 frozen weights',
    'nograd': 'forward + backward through the activations, no weight gradients',
    'adafactor': 'full weights, Adafactor',
    'adam': 'full weights, TF1 Adam',
}
SIZES = {'124M': dict(n_embd=768, n_head=12, n_layer=12), '1558M': dict(n_embd=1600, n_head=25, n_layer=48)}


def checkpoint(size: str) -> pathlib.Path:
    """bench/.cache/<size>-random: the size's shapes, N(0, 0.02) values, gains at 1, written tensor by tensor."""
    folder = CACHE / f'{size}-random'
    if (folder / 'checkpoint').exists():
        return folder
    import numpy as np
    import tensorflow as tf

    from gpt2_tf.checkpoint import variable_shapes
    from gpt2_tf.hparams import HParams

    hparams = HParams(n_vocab=50257, n_ctx=1024, **SIZES[size])
    folder.mkdir(parents=True, exist_ok=True)
    rng, parts = np.random.default_rng(0), []
    with tempfile.TemporaryDirectory(dir=CACHE) as staging:
        for i, (name, shape) in enumerate(sorted(variable_shapes(hparams).items())):
            value = np.ones(shape, np.float32) if name.endswith('/g') else rng.normal(0, 0.02, shape).astype(np.float32)
            parts.append(os.path.join(staging, f'part-{i}'))
            tf.raw_ops.SaveV2(prefix=parts[-1], tensor_names=[name], shape_and_slices=[''], tensors=[value])
            del value
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=str(folder / 'model.ckpt'))
    (folder / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    hparams.to_json(str(folder / 'hparams.json'))
    return folder


CHILD = r'''
import json, sys, time
import numpy as np, tensorflow as tf
import gpt2_tf
from gpt2_tf.model import positions_for
from gpt2_tf.scoring import frozen_head_loss
from gpt2_tf.train import Trainer, recomputed

def mark(phase):
    print(json.dumps({'phase': phase}), flush=True)

case, folder, length, steps, recompute, batch = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                 sys.argv[5] == '1', int(sys.argv[6]))
model = gpt2_tf.load_model(folder, dtype='int8' if case == 'lora-int8' else 'float32')
mark('loaded')
tokens = np.random.default_rng(0).integers(0, 50257, (batch, length)).astype(np.int32)
if case == 'nograd':
    wrap = recomputed if recompute else None
    @tf.function(autograph=False)
    def run(tokens):
        with tf.GradientTape() as tape:
            h = model.embed(tokens, positions_for(tokens, 0))
            tape.watch(h)
            out, _ = model.blocks(h, wrap=wrap)
            loss = frozen_head_loss(model, out[:, :-1], tokens[:, 1:])  # as a LoRA step's
        return loss, tf.reduce_sum(tape.gradient(loss, h))
    step = lambda t: float(run(tf.constant(t))[0])
else:
    options = dict(lora_rank=8, lora_targets='c_attn') if case.startswith('lora') else {}
    trainer = Trainer(model, 1e-4, 'adafactor' if case == 'adafactor' else 'adam', 1, recompute, **options)
    step = trainer.step
mark('optimizer state made')
start = time.perf_counter()
step(tokens)
first = time.perf_counter() - start
mark('first step done')
times, cpu = [], []
for _ in range(steps):
    start, busy = time.perf_counter(), time.process_time()
    step(tokens)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - busy)
with open('/proc/self/status') as f:
    peak = next(int(l.split()[1]) / 1024 for l in f if l.startswith('VmHWM'))
print(json.dumps({'first_s': first, 'step_s': min(times) if times else first, 'cpu_s': min(cpu) if cpu else None,
                  'peak_mb': peak}), flush=True)
'''


def rss_mb(pid: int) -> float:
    try:
        with open(f'/proc/{pid}/status') as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith('VmRSS')), 0.0)
    except OSError:
        return 0.0


def run_case(case: str, folder, length: int, steps: int, limit_mb: float, recompute: bool, batch: int) -> dict:
    """The case in a fresh process under the RSS watchdog -> its result, or where it stopped."""
    import threading

    process = subprocess.Popen([sys.executable, '-c', CHILD, case, str(folder), str(length), str(steps), str(int(recompute)),
                                str(batch)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    items = []
    reader = threading.Thread(target=lambda: items.extend(json.loads(line) for line in process.stdout), daemon=True)
    reader.start()
    highest = 0.0
    while process.poll() is None:
        highest = max(highest, rss_mb(process.pid))
        if highest > limit_mb:
            process.kill()
            break
        time.sleep(0.05)
    process.wait()
    reader.join()
    phases = [item['phase'] for item in items if 'phase' in item]
    phase = phases[-1] if phases else 'nothing (loading)'
    if highest > limit_mb:
        return {'stopped': f'killed at {highest / 1024:.1f} GB RSS (limit {limit_mb / 1024:.0f} GB) after: {phase}'}
    if process.returncode:
        return {'stopped': f'exit {process.returncode} after: {phase}, at {highest / 1024:.1f} GB RSS'}
    return {k: v for item in items for k, v in item.items() if k != 'phase'}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--size', choices=sorted(SIZES), default='124M')
    parser.add_argument('--length', type=int, default=1024)
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--steps', type=int, default=1)
    parser.add_argument('--rounds', type=int, default=1)
    parser.add_argument('--limit-gb', type=float, default=15.0)
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--no-recompute', dest='recompute', action='store_false',
                        help='recompute=False on every side (finetune\'s default)')
    args = parser.parse_args()
    from bench_generate import cpu

    folder = checkpoint(args.size)
    cases = args.cases.split(',')
    results = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            results[case].append(run_case(case, folder, args.length, args.steps, args.limit_gb * 1024, args.recompute,
                                                 args.batch))
            print(case, results[case][-1], flush=True)
    print(f'\n{args.size}, batch {args.batch}, T={args.length}, recompute={args.recompute}; CPU: {cpu()}; best of {args.rounds} round(s)')
    print('| case | step (s) | step CPU time (s) | first step (s) | peak RSS (GB) |\n|---|---|---|---|---|')
    best = {}
    for case in cases:
        done = [r for r in results[case] if 'step_s' in r]
        if not done:
            print(f'| {CASES[case]} | {results[case][-1]["stopped"]} | | | |')
            continue
        best[case] = min(done, key=lambda r: r['step_s'])
        r = best[case]
        busy = '' if r.get('cpu_s') is None else f'{r["cpu_s"]:.2f}'
        print(f'| {CASES[case]} | {r["step_s"]:.2f} | {busy} | {r["first_s"]:.1f} | {r["peak_mb"] / 1024:.2f} |')
    for a, b in (('lora', 'adam'), ('lora', 'nograd'), ('lora-int8', 'lora')):
        if a in best and b in best:
            busy = (f', CPU time {best[a]["cpu_s"] / best[b]["cpu_s"]:.2f}x'
                    if best[a].get('cpu_s') and best[b].get('cpu_s') else '')
            print(f'{a} / {b}: step {best[a]["step_s"] / best[b]["step_s"]:.2f}x{busy}, '
                  f'peak {best[a]["peak_mb"] / best[b]["peak_mb"]:.2f}x')


if __name__ == '__main__':
    main()
