"""Input checks, in one place: the model, sampling, scoring and the command line all call these.

Each raises GPT2Error (a ValueError) with a one-line message that names the problem; none
imports TensorFlow, so the command line can check its arguments before
loading it.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator, Sequence

import numpy as np

DTYPES = ('float32', 'bfloat16', 'float16', 'int8')  # the weights' precisions (gpt2_tf.precision)
LITERT_DTYPES = ('float32', 'int8')  # those a LiteRT export holds (gpt2_tf.litert)
INT64 = np.iinfo(np.int64)


class GPT2Error(ValueError):
    """The project's own error: a one-line message that names the problem and the next step.

    Every check here raises it, and so do the checkpoint, HF and download
    modules (through subclasses); the command line prints it and exits 2.
    """


def first_line(error: BaseException) -> str:
    """An exception's message in one line: its first; for TensorFlow's graph errors, whose first says only
    'Graph execution error:' before the stack, the line after the stack that says what failed; the type's
    name when the message is empty."""
    lines = [line for line in (getattr(error, 'message', None) or str(error)).strip().splitlines() if line.strip()]
    if lines and lines[0].endswith('execution error:'):
        said = [line for line in lines[1:] if not line[0].isspace() and not line.startswith('Detected at node')]
        lines = said or lines
    return re.sub(r'^\{\{function_node [^}]*\}\}\s*', '', lines[0]) if lines else type(error).__name__


@contextlib.contextmanager
def replacing(path) -> Iterator[str]:
    """A temporary path beside path, renamed over it when the block ends, removed when it fails: path holds the
    new file whole, or what it held before (the same file system, so the rename is atomic)."""
    temporary = f'{os.fspath(path)}.tmp-{os.getpid()}'
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def save_folder(path) -> str:
    """The folder a save writes into, created with its parents; a file at that path is refused in one line."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise GPT2Error(f'{path} is a file, not a folder: save into a folder')
    os.makedirs(path, exist_ok=True)
    return path


PARTIAL = '.gpt2_tf-partial-'  # + the writer's pid: an export's staging inside the folder it fills


def left_behind(entry: str, prefix: str = PARTIAL) -> bool:
    """Whether a folder's entry is the staging of an export whose process has gone (killed mid-write): named
    prefix + the writer's pid + '-' + mkdtemp's eight characters, exactly (a user's '.out.partial-2024-01-15'
    is not one). A pid that a live process holds again counts as its writer: left, never removed."""
    named = re.fullmatch(re.escape(prefix) + r'([0-9]+)-[a-z0-9_]{8}', entry)
    if named is None:
        return False
    pid = named.group(1)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # another user's process: alive; a number past any pid: not our staging
        return False
    return False


def check_new_folder(path) -> str:
    """A folder an export creates: missing or empty (an export never mixes with other files; what a killed
    export left staged in it does not count, another export's running one does)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise GPT2Error(f'{path} is a file: give a new folder to write into')
    if os.path.isdir(path) and [e for e in os.listdir(path) if not left_behind(e)]:
        raise GPT2Error(f'{path} exists and is not empty: write into a new folder')
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above):  # the first folder above that exists: it must be a folder
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise GPT2Error(f'{above} is a file, so {path} cannot be made: give a folder outside it')
    return path


OFF = ('off', '0', 'false', 'no', 'none')  # what turns a setting off (GPT2_TF_KERNELS, GPT2_TF_XLA_CACHE)
ON = ('', 'on', '1', 'true', 'yes')  # what leaves one on, unset included (quiet.switch)


def is_off(value: str) -> bool:
    return value.strip().lower() in OFF


MAX_TEMPERATURE = 2.0  # the accepted range is [0, MAX_TEMPERATURE]; 0 is greedy


def shown(value) -> str:
    """A value as a user typed it, for messages: 3.0, not np.float64(3.0); strings quoted."""
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value) if isinstance(value, (str, list, tuple, dict)) or value is None else str(value)


def is_int(x) -> bool:
    """A Python or numpy integer, and not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def token_array(tokens, *, name: str = 'tokens') -> np.ndarray:
    """tokens as a numpy integer array, without casting (an int64 id 2**32 + 5 stays what it is)."""
    try:
        array = np.asarray(tokens)
    except ValueError:  # rows of different lengths, or ids beside rows
        raise GPT2Error(f'{name} must be one array of token ids, got rows of mixed lengths or nesting') from None
    if array.dtype.kind in 'SU':
        raise GPT2Error(f'{name} must be token ids, got text: encode it first (gpt2_tf.encode)')
    if array.dtype == object or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise GPT2Error(f'{name} must be integers, got {array.dtype if array.dtype != object else "mixed values"}')
    return array


def check_token_ids(tokens, n_vocab: int, *, name: str = 'token', encoded: bool = False) -> None:
    """Raises for any id outside [0, n_vocab). Call it before casting to int32. encoded=True: the ids are what the
    encoder gave for text, and the next step is the model's own vocabulary files, not other ids."""
    array = np.asarray(tokens)
    if array.size == 0:
        return
    low, high = array.min(), array.max()
    if low < 0 or high >= n_vocab:
        bad = low if low < 0 else high
        remedy = ('the vocabulary files hold more tokens than the model: use the ones made for it' if encoded else
                  f'give ids below {n_vocab}, from this model\'s own vocabulary')
        raise GPT2Error(f'{name} id {int(bad)} is outside the vocabulary [0, {n_vocab}): {remedy}')


NOT_DRAWN = ("the model's logits were not finite (NaN or +inf), so no token could be drawn: its weights hold NaN, "
             "or its activations overflowed its dtype (load it in float32)")


def undecodable(text: str):
    """Where the first undecodable byte's stand-in (surrogateescape's U+DC80-U+DCFF, as a command line's
    argument holds it) is in text, or None."""
    return next((i for i, c in enumerate(text) if '\udc80' <= c <= '\udcff'), None)


def check_utf8(text: str, *, name: str = 'the prompt') -> None:
    """Refuses text holding undecodable bytes (the encoder would read each as U+FFFD)."""
    odd = undecodable(text)
    if odd is not None:
        raise GPT2Error(f'{name} is not UTF-8 text (byte 0x{ord(text[odd]) - 0xdc00:02x} at character {odd}): '
                        f'give it in UTF-8')


def check_drawn(tokens, n_vocab: int) -> None:
    """A decode loop's tokens: an id outside the vocabulary is what a row holding a NaN or +inf logit draws."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= n_vocab):
        raise GPT2Error(NOT_DRAWN)


def check_api_key(key, *, name: str = 'api_key') -> None:
    """A server's key, when one is given, is a word a client can send: an empty one (an unset $KEY) would lock
    every client out, and HTTP drops the whitespace around a header's value."""
    if key is not None and not key.strip():
        raise GPT2Error(f'{name} is empty: give a key, or leave {name} out to serve without one')
    if key is not None and key != key.strip():
        raise GPT2Error(f'{name} starts or ends with whitespace, which HTTP drops from the header a client sends: '
                        f'give it without')


def check_litert(dtype: str, max_len, n_ctx: int) -> int:
    """A LiteRT export's options, checked before TensorFlow loads: max_len (n_ctx when None)."""
    max_len = n_ctx if max_len is None else max_len
    if not is_int(max_len) or not 1 <= max_len <= n_ctx:
        raise GPT2Error(f'--max-len must be an integer in [1, {n_ctx}] (n_ctx), got {max_len}')
    if dtype not in LITERT_DTYPES:
        raise GPT2Error(f'--dtype for a LiteRT export must be one of {", ".join(LITERT_DTYPES)}, got {dtype}')
    return int(max_len)  # a numpy integer passes the check, and json.dump refuses it after the whole conversion


def check_window(prompt: int, length: int, n_ctx: int, *, what: str = 'prompt', name: str = 'length') -> None:
    """The length rule: a prompt of P tokens and `length` new ones need P + length - 1 <= n_ctx (name: what the
    caller calls the length, the server's max_tokens).

    The last sampled token is never fed back to the model, as in the original
    sample_sequence, so it needs no position of its own.
    """
    if prompt + length - 1 > n_ctx:
        over = prompt + length - 1 - n_ctx
        raise GPT2Error(f'{what}: {prompt} tokens + {name} {length} exceeds the window by {over} '
                         f'(needs prompt + {name} - 1 <= n_ctx = {n_ctx}): shorten the prompt or ask for fewer '
                         f'new tokens')


def check_sequence(past_length: int, new: int, n_ctx: int) -> None:
    """One model call sees past_length + new positions, at most n_ctx."""
    if past_length + new > n_ctx:
        raise GPT2Error(f'sequence too long: {past_length} past + {new} new tokens > n_ctx = {n_ctx}')


def check_model_inputs(tokens, past, past_shape: list, *, n_vocab: int, n_ctx: int) -> np.ndarray:
    """tokens [batch, sequence] as a checked integer array; past, when given, must have past_shape
    (whose None entries are the batch, which must be tokens', and the past length).

    Ids are checked before any cast (an int64 2**32 + 5 is not id 5), and always:
    on a GPU, tf.gather returns zeros for an out-of-range id instead of failing.
    """
    try:
        tokens = token_array(tokens)
    except ValueError as e:
        raise GPT2Error(f'tokens must be a [batch, sequence] array of integers ({e})') from None
    if tokens.ndim != 2:
        raise GPT2Error(f'tokens must be [batch, sequence], got shape {list(tokens.shape)}')
    check_token_ids(tokens, n_vocab)
    past_length = 0
    if past is not None:
        try:
            got = list(np.shape(past))
        except ValueError:  # a ragged sequence
            raise GPT2Error('past must be an array of floats, the present a call returned; got a ragged '
                            'sequence') from None
        dtype = getattr(past, 'dtype', None) or np.asarray(past).dtype
        if not (getattr(dtype, 'is_floating', False) or np.dtype(dtype).kind == 'f'):
            raise GPT2Error(f'past must be an array of floats, the present a call returned; got {dtype}')
        past_shape = [tokens.shape[0]] + list(past_shape[1:])
        if len(got) != len(past_shape) or any(w is not None and w != g for w, g in zip(past_shape, got)):
            want = str(past_shape).replace('None', 'past_length')
            raise GPT2Error(f'past must have shape {want}, got {got}')
        past_length = got[4]
    check_sequence(past_length, tokens.shape[1], n_ctx)
    return tokens


def room_for_prompt(length: int, n_ctx: int) -> int:
    """The longest prompt that leaves room for `length` new tokens under the length rule."""
    return n_ctx - length + 1


def default_length(n_ctx: int, conditional: bool) -> int:
    """The original scripts' defaults: half the window after a prompt, the whole window without one."""
    return n_ctx // 2 if conditional else n_ctx


def check_length(length, n_ctx: int) -> None:
    if not is_int(length) or length < 1:
        raise GPT2Error(f'length must be a positive integer, got {shown(length)}')
    if length > n_ctx:
        raise GPT2Error(f"length {length} is longer than the window: at most n_ctx = {n_ctx} new tokens")


def per_row(value, batch: int, name: str) -> np.ndarray:
    """A scalar option repeated for each row, or one value per row given as a sequence (a list's values kept as
    given: [1, 2.5] is not made [1.0, 2.5], so a check names the value that fails)."""
    array = np.asarray(value, dtype=object) if isinstance(value, (list, tuple)) else np.asarray(value)
    if array.ndim == 0:  # its own dtype: an integer past int64 stays a Python int (object), to be refused or capped
        return np.full([batch], array.item(), dtype=array.dtype)
    if array.shape != (batch,):
        raise GPT2Error(f'{name} must be a number or one value per row ({batch}), got shape {array.shape}')
    return array


def check_sampling(temperature, top_k, top_p, batch: int) -> tuple:
    """Per-row float32 temperature, int32 top_k, float32 top_p, after checking each value."""
    temperature = per_row(temperature, batch, 'temperature')
    top_k = per_row(top_k, batch, 'top_k')
    top_p = per_row(top_p, batch, 'top_p')
    for t in temperature:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.number)) \
                or not 0 <= t <= MAX_TEMPERATURE:
            raise GPT2Error(f'temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), got {shown(t)}')
    for k in top_k:
        if not is_int(k) or k < 0:
            raise GPT2Error(f'top_k must be an integer >= 0 (0: no truncation), got {shown(k)}')
    for p in top_p:
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.number)) or not 0 <= p <= 1:
            raise GPT2Error(f'top_p must be in [0, 1] (1: no truncation), got {shown(p)}')
    top_k = np.array([min(int(k), np.iinfo(np.int32).max) for k in top_k], np.int32)  # past n_vocab: no truncation
    return temperature.astype(np.float32), top_k, top_p.astype(np.float32)


def check_stride(stride, n_ctx: int) -> None:
    """A scoring window's stride: an integer in [1, n_ctx - 1], or None for the default."""
    if stride is not None and (not is_int(stride) or not 1 <= stride <= n_ctx - 1):
        raise GPT2Error(f'stride must be an integer in [1, {n_ctx - 1}] (n_ctx - 1), got {shown(stride)}')


def check_seed(seed, batch: int) -> None:
    """A seed is an int, a pair of ints, or one pair per row ([batch, 2]); each within int64."""
    def fits(values: Sequence) -> bool:
        return all(is_int(v) and INT64.min <= v <= INT64.max for v in values)

    if is_int(seed):
        if not fits([seed]):
            raise GPT2Error(f'seed {seed} is out of range: use an integer in [{INT64.min}, {INT64.max}]')
        return
    array = np.asarray(seed, dtype=object)
    if array.shape == (2,) or array.shape == (batch, 2):
        if fits(array.ravel().tolist()):
            return
        raise GPT2Error(f'seed values must be integers in [{INT64.min}, {INT64.max}], got {shown(seed)}')
    raise GPT2Error(f'seed must be an integer, a pair of integers, or one pair per row [{batch}, 2]; '
                     f'got {shown(seed)}')


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
REPETITION_RANGE = (0.01, 100.0)  # repetition_penalty: far past any use (CTRL's 1.2), and finite in float32 logits


def is_number(x) -> bool:
    """A real, finite Python or numpy number, and not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)) \
        and abs(x) < float('inf')  # not NaN either: every comparison with NaN is False


def check_logit_bias(logit_bias, batch: int, n_vocab: int) -> list:
    """logit_bias (None, one dict {token id: bias} for every row, or one dict or None per row) -> one dict per row,
    {int id: float bias}, each id in the vocabulary and each bias in [-100, 100]."""
    if logit_bias is None or isinstance(logit_bias, dict):
        rows = [logit_bias] * batch
    elif isinstance(logit_bias, (list, tuple)) and len(logit_bias) == batch:
        rows = list(logit_bias)
    else:
        got = f'a list of {len(logit_bias)}' if isinstance(logit_bias, (list, tuple)) else shown(logit_bias)
        raise GPT2Error(f'logit_bias must be a dict {{token id: bias}}, or one dict (or None) per row ({batch}); '
                         f'got {got}')
    checked = []
    for row in rows:
        if row is not None and not isinstance(row, dict):
            raise GPT2Error(f'logit_bias entries must be dicts {{token id: bias}} or None, got {shown(row)}')
        for token, bias in (row or {}).items():
            if not is_int(token):
                raise GPT2Error(f'logit_bias keys must be integer token ids (convert JSON\'s string keys with int), '
                                 f'got {shown(token)}')
            check_token_ids([token], n_vocab, name='logit_bias: token')
            if not is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise GPT2Error(f'logit_bias for token {token} must be a number in [-{MAX_LOGIT_BIAS:g}, '
                                 f'{MAX_LOGIT_BIAS:g}] (-100 bans, 100 forces), got {shown(bias)}')
        checked.append({int(token): float(bias) for token, bias in (row or {}).items()})
    return checked


def check_penalties(presence_penalty, frequency_penalty, repetition_penalty, batch: int) -> tuple:
    """Per-row float32 presence, frequency and repetition penalties, after checking each value: presence and
    frequency in [-2, 2] (0: none), repetition in [0.01, 100] (1: none)."""
    presence = per_row(presence_penalty, batch, 'presence_penalty')
    frequency = per_row(frequency_penalty, batch, 'frequency_penalty')
    repetition = per_row(repetition_penalty, batch, 'repetition_penalty')
    for name, values in (('presence_penalty', presence), ('frequency_penalty', frequency)):
        for x in values:
            if not is_number(x) or not -MAX_PENALTY <= x <= MAX_PENALTY:
                raise GPT2Error(f'{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: none), '
                                 f'got {shown(x)}')
    low, high = REPETITION_RANGE
    for x in repetition:
        if not is_number(x) or not low <= x <= high:
            raise GPT2Error(f'repetition_penalty must be a number in [{low:g}, {high:g}] (1: none; above 1 '
                             f'discourages repeats), got {shown(x)}')
    return presence.astype(np.float32), frequency.astype(np.float32), repetition.astype(np.float32)


PAGE_ATTENTION = 2 ** 24  # attention weights an explorer page holds at most (one byte each; n_layer·n_head·T²)


def check_explorer_prompt(count: int, n_layer: int, n_head: int, n_ctx: int, *, name: str = 'the prompt') -> None:
    """An explorer page's prompt: 1 to n_ctx tokens, and few enough that the page's n_layer·n_head·T² attention
    weights stay within PAGE_ATTENTION (a browser draws each head's T x T map)."""
    most = min(n_ctx, int((PAGE_ATTENTION / (n_layer * n_head)) ** 0.5))
    if count == 0:
        raise GPT2Error(f'{name} is empty: give some text')
    if count > most:
        why = (f'more than n_ctx = {n_ctx}' if most == n_ctx else
               f'more than an explorer page draws for {n_layer} blocks of {n_head} heads ({most}; its attention '
               f'maps hold n_layer·n_head·T² weights, at most {PAGE_ATTENTION:,})')
        raise GPT2Error(f'{name} has {count} tokens, {why}: shorten it to at most {most} tokens')

