"""Load test of the completions server on 127.0.0.1: 1, 8 and 32 concurrent clients, bounded request counts.

    python bench/bench_serve.py [--requests 64] [--max-tokens 32] [--model-dir DIR]

Starts `gpt2-tf serve` in a subprocess (the 124M-shaped random checkpoint by
default), warms it up, then for each concurrency sends --requests completions
through the official openai client and reports requests/s, generated tokens/s
and p50/p99 latency. Every response is checked: well-formed, the asked number
of tokens (or a stop), nothing lost.
"""

import argparse
import concurrent.futures
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--requests', type=int, default=64, help='completions per concurrency level')
    parser.add_argument('--max-tokens', type=int, default=32)
    parser.add_argument('--concurrency', default='1,8,32')
    parser.add_argument('--model-dir', default=None)
    parser.add_argument('--max-batch', type=int, default=16)
    args = parser.parse_args()

    import openai

    from bench_generate import checkpoint, cpu
    folder = args.model_dir or str(checkpoint())
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, '-m', 'gpt2_tf.cli', 'serve', '--model_dir', folder, '--port',
                               str(port), '--max-batch', str(args.max_batch), '--queue-size', '512'],
                              stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit('the server did not start')
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=600)
        print(f'CPU: {cpu()}')
        print(f'model {folder}, {args.requests} requests per level, max_tokens {args.max_tokens}, '
              f'server --max-batch {args.max_batch}')

        def one(i):
            start = time.perf_counter()
            done = client.completions.create(model=os.path.basename(os.path.normpath(folder)),
                                             prompt=f'Request number {i}: once upon a time',
                                             max_tokens=args.max_tokens, seed=i)
            choice = done.choices[0]
            assert choice.finish_reason in ('length', 'stop') and isinstance(choice.text, str)
            assert done.usage.completion_tokens == args.max_tokens or choice.finish_reason == 'stop'
            return time.perf_counter() - start, done.usage.completion_tokens

        # Warm-up: compile the waves of each batch size the levels will use (1, 2, 4, ... max_batch).
        size = 1
        while size <= args.max_batch:
            with concurrent.futures.ThreadPoolExecutor(size) as pool:
                list(pool.map(one, range(size)))
            size *= 2
        print(f'{"clients":>8}{"requests/s":>12}{"tokens/s":>10}{"p50 s":>8}{"p99 s":>8}  check')
        for level in map(int, args.concurrency.split(',')):
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(level) as pool:
                results = list(pool.map(one, range(args.requests)))
            elapsed = time.perf_counter() - start
            latency = sorted(r[0] for r in results)
            tokens = sum(r[1] for r in results)
            p99 = latency[min(len(latency) - 1, int(0.99 * len(latency)))]
            print(f'{level:>8}{len(results) / elapsed:>12.2f}{tokens / elapsed:>10.1f}{statistics.median(latency):>8.2f}'
                  f'{p99:>8.2f}  {len(results)}/{args.requests} well-formed', flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == '__main__':
    main()
