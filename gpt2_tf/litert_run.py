"""Run an exported LiteRT GPT-2 with nothing but the LiteRT interpreter, numpy and the tokenizer.

    python -m gpt2_tf.litert_run OUT_DIR "prompt" --length 40 [--top_k 40 --temperature 1 --seed 1]

This is the loop to port to Kotlin or Swift: encode the prompt, prefill it into
an empty cache, then decode one token at a time, feeding each back at the next
position. Greedy by default; with --top_k it draws as the library does
(temperature, the top_k filter, and Gumbel-max with the library's SplitMix64
noise), so seed s gives the tokens of sample_sequence(..., seed=[[s, 0]]);
generate() without a seed draws at random, as the library does.
No TensorFlow is imported, and generate() on token ids needs only numpy and
the LiteRT runtime (the tokenizer, for text, also needs regex).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

import numpy as np

from . import validate
from .train_config import check_integer
from .validate import GPT2Error

_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64, as gpt2_tf.noise: the same bits for the same (key, step, token)
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
BITS = 23


def _mix64(z: np.ndarray) -> np.ndarray:
    for shift, factor in zip((30, 27), _MIX):
        z = (z ^ (z >> np.uint64(shift))) * np.uint64(factor)
    return z ^ (z >> np.uint64(31))


def gumbel(key: tuple, step: int, n_vocab: int) -> np.ndarray:
    """float32 [n_vocab] Gumbel noise for one row's key pair at one step."""
    with np.errstate(over='ignore'):
        k = np.array(key, np.int64).view(np.uint64)
        state = _mix64(_mix64(_mix64(k[:1] + np.uint64(_GOLDEN)) + k[1:]) + np.array([step], np.int64).view(np.uint64))
        bits = _mix64(state + (np.arange(n_vocab, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN))
    u = ((bits >> np.uint64(64 - BITS)).astype(np.float32) + np.float32(0.5)) / np.float32(1 << BITS)
    return -np.log(-np.log(u))


def choose(logits: np.ndarray, step: int, *, top_k: int, temperature: float, key: tuple) -> int:
    """The next token from float32 logits [n_vocab]: the argmax, or a top_k draw."""
    if np.isnan(logits).any():  # no token is the likeliest (argmax would say 0): the library refuses them too
        raise GPT2Error(validate.NOT_DRAWN)
    if top_k == 1 or temperature == 0:
        return int(np.argmax(logits))
    kept = logits >= np.sort(logits)[-top_k] if 0 < top_k < logits.size else np.ones(logits.shape, bool)
    z = (logits - logits.max()) / np.float32(temperature)  # as the library scales before the noise
    noisy = np.where(kept, z + gumbel(key, step, logits.size), -np.inf)
    return int(np.argmax(noisy))


def cache_shape(description: dict) -> list:
    """An export's kv_cache shape, from its model.json."""
    return description['signatures']['decode']['inputs']['kv_cache']['shape']


def export_of(folder: str) -> dict:
    """An export folder's model.json, holding what a run reads; a folder that is not one is refused in one line."""
    paths = [os.path.join(folder, name) for name in ('model.json', 'model.tflite')]
    if not all(os.path.isfile(path) for path in paths):
        raise GPT2Error(f'{folder} is not a LiteRT export (model.tflite and its model.json): write one with '
                        f'gpt2-tf export MODEL {folder} --format litert')
    try:
        with open(paths[0], encoding='utf-8') as f:
            description = json.load(f)
        complete = described(description)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        complete = False
    if not complete:
        raise incomplete(folder, 'its model.json lacks the cache shape or the hparams a run reads')
    return description


def described(description: dict) -> bool:
    """Whether model.json holds what a run reads: the cache's six sizes, n_vocab and n_ctx, each a positive int."""
    shape, hparams = cache_shape(description), description['hparams']
    sizes = [*shape, hparams['n_vocab'], hparams['n_ctx']]
    return len(shape) == 6 and all(validate.is_int(n) and n > 0 for n in sizes)


def incomplete(folder: str, why: str) -> GPT2Error:
    return GPT2Error(f'{folder} is not a complete LiteRT export ({why}): export it again with '
                     f'gpt2-tf export MODEL {folder} --format litert')


def signatures(folder: str, description: dict, threads: int) -> list:
    """The prefill and decode signature runners of the folder's model.tflite; a file the interpreter cannot read,
    or whose cache and logits are not the ones its model.json describes, is refused in one line."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise GPT2Error("running a LiteRT export needs the LiteRT runtime: pip install -e '.[litert]' "
                        "(or pip install ai-edge-litert)") from None
    check_integer('threads', threads, 1)  # checked here: the interpreter's own error would read as damage
    try:
        interpreter = Interpreter(model_path=os.path.join(folder, 'model.tflite'), num_threads=threads)
        runners = [interpreter.get_signature_runner(name) for name in ('prefill', 'decode')]
        shapes = [(r.get_input_details()['kv_cache']['shape'].tolist(), r.get_output_details()['logits']['shape'][-1])
                  for r in runners]
    except (ValueError, KeyError, RuntimeError):  # the interpreter's words for an empty, truncated or foreign file
        shapes = None
    if shapes != [(cache_shape(description), description['hparams']['n_vocab'])] * 2:
        raise incomplete(folder, 'its model.tflite is damaged, or is not the model its model.json describes')
    return runners


def check_fits(description: dict, ids, length: int) -> list:
    """The prompt's ids (a list, a tuple, a numpy array: any one row of integers) as a list, after checking that
    they are the model's, and that the prompt and length fit the export's cache."""
    array = validate.token_array(ids, name='the prompt')
    if array.ndim != 1:
        raise GPT2Error(f'the prompt must be one row of token ids, got shape {list(array.shape)}: give a 1-D one')
    if not array.size:
        raise GPT2Error('the prompt is empty: give some text')
    validate.check_token_ids(array, description['hparams']['n_vocab'], name="the prompt's token")
    ids = array.tolist()
    positions, n_ctx = cache_shape(description)[4], description['hparams']['n_ctx']
    need = len(ids) + length - 1 if validate.is_int(length) and length >= 1 else 0  # the last is not fed back
    if need > positions and positions < n_ctx:
        raise GPT2Error(f'the prompt ({len(ids)} tokens) and length {length} need {need} positions; '
                        f'this export\'s cache has {positions}: export again with a larger --max-len (at most '
                        f'n_ctx = {n_ctx}), or ask for fewer tokens')
    validate.check_length(length, positions)
    validate.check_window(len(ids), length, positions, what='the prompt')
    return ids


def draw_options(top_k, temperature, seed) -> tuple:
    """(top_k, temperature, key) by the library's rules: seed s is the library's seed=[[s, 0]], and None a random
    key, as noise.row_keys draws one."""
    temperatures, top_ks, _ = validate.check_sampling(temperature, top_k, 1.0, 1)
    if seed is None:
        return int(top_ks[0]), temperatures[0], (secrets.randbits(63), secrets.randbits(63))
    if not validate.is_int(seed):  # a pair would be folded by the library (Philox), which this runner does not do
        raise GPT2Error(f"seed must be an integer s (the library's seed=[[s, 0]]) or None (a random draw), "
                        f'got {validate.shown(seed)}')
    validate.check_seed(seed, 1)
    return int(top_ks[0]), temperatures[0], (int(seed), 0)


def generate(folder: str, ids, length: int, *, top_k: int = 1, temperature: float = 1.0,
             seed=None, threads: int = 2) -> list:
    """length new token ids after the prompt ids, through the folder's model.tflite.

    top_k=1 (the default) or temperature=0 takes the argmax; otherwise each token is the library's draw (top_k=0:
    from the whole vocabulary), with the noise of seed, or of a random key when seed is None.
    """
    description = export_of(folder)
    ids = check_fits(description, ids, length)
    top_k, temperature, key = draw_options(top_k, temperature, seed)
    prefill, decode = signatures(folder, description, threads)
    out = prefill(tokens=np.array([ids], np.int32), input_pos=np.arange(len(ids), dtype=np.int32),
                  kv_cache=np.zeros(cache_shape(description), np.float32))
    new = []
    for step in range(length):
        new.append(choose(out['logits'][0], step, top_k=top_k, temperature=temperature, key=key))
        if step + 1 < length:  # the last token is never fed back
            out = decode(tokens=np.array([[new[-1]]], np.int32),
                         input_pos=np.array([len(ids) + step], np.int32), kv_cache=out['kv_cache'])
    return new


def encoder_of(folder: str):
    """The export's tokenizer, imported here: it needs the regex package, which generate on token ids does not."""
    try:
        from .encoder import get_encoder
    except ImportError as e:
        raise GPT2Error(f"encoding the prompt's text needs the {e.name} package: pip install {e.name}") from None
    return get_encoder(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gpt2_tf.litert_run', description=__doc__.split('\n')[0])
    parser.add_argument('folder', help='a folder written by gpt2-tf export --format litert')
    parser.add_argument('prompt', help='the text to continue')
    parser.add_argument('--length', type=int, default=40, help='new tokens (default: 40)')
    parser.add_argument('--top_k', type=int, default=0, help='draw among the k likeliest (default: 0, greedy)')
    parser.add_argument('--temperature', type=float, default=1.0, help='for --top_k draws (default: 1.0)')
    parser.add_argument('--seed', type=int, default=0, help='for --top_k draws (default: 0)')
    args = parser.parse_args(argv)
    try:  # the library's rules, in one line each
        description = export_of(args.folder)
        validate.check_utf8(args.prompt)
        encoder = encoder_of(args.folder)
        ids = encoder.encode(args.prompt)
        validate.check_token_ids(ids, description['hparams']['n_vocab'], name="the prompt's token", encoded=True)
        new = generate(args.folder, ids, args.length, top_k=args.top_k or 1, temperature=args.temperature,
                       seed=args.seed)  # --top_k 0, the command's default, is greedy
    except GPT2Error as e:  # one line, as gpt2-tf's; argparse's own usage errors come before
        print(f'{parser.prog}: error: {e}', file=sys.stderr)
        return 2
    print(args.prompt + encoder.decode(new))
    return 0


if __name__ == '__main__':
    sys.exit(main())
