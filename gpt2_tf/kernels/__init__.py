"""Small C++ kernels, compiled on first use against the installed TensorFlow, with a pure-TensorFlow fallback.

    y = int8_matmul(x, w, scale)                    # x [M, K] float32, w int8 [K, N], scale [N] -> [M, N]
    y = int8_matmul(x, w, scale, transpose_w=True)  # w int8 [N, K] (wte), scale [N] -> [M, N]
    y = int8_matmul(x, w, scale, panel=128)         # w [K, N] stored as panels [N / 128, K, 128]
    y = float_matmul(x, w)                          # x [M, K] float32, w float32 [K, N] (or [N, K]) -> [M, N]
    a = cached_attention(q, cache, mask)            # q [B, H, F], cache [B, 2, H, S, F], mask [B, S] -> [B, H, F]
    a = causal_attention(q, k, v)                   # q, k, v [B, H, T, F], one whole sequence -> [B, H, T, F]

The kernel (matmul.cc) reads the int8 weights themselves and widens them
next to the multiply, so a product streams a quarter of float32's bytes. It is
built with the machine's g++ and TensorFlow's own compile flags into a cache
folder ($GPT2_TF_KERNEL_CACHE, default ~/.cache/gpt2_tf/kernels), keyed by the
source, TensorFlow's version and build flags, g++'s version, the CPU and the target ($GPT2_TF_KERNEL_ARCH, g++'s
-march: native by default; x86-64-v3 builds the AVX2 path on an AVX-512 machine; a
target set there that does not build is refused, not skipped), so it works from a
plain checkout.
Built with TensorFlow's XLA headers where they compile, the op also runs inside
XLA-compiled functions, as a custom call (xla_available()); otherwise the library
holds the op alone (an XLA build that g++ failed on its sources is not tried again
for the same key; a full disk or a killed compiler is), and XLA-compiled functions
take TensorFlow's ops. Where no compiler is there, or GPT2_TF_KERNELS=off (0, false,
no), the same product runs as
TensorFlow ops: the weights unpacked from their panels, cast to float32, scaled,
and multiplied. Both sum in float32; they agree to float32 rounding (the tests compare them).

The same library multiplies float32 weights in their plain layout over few rows
(float_matmul): XLA's float32 dots over 1-16 rows (a decode step at batch 1-16)
run below the machine's bounds, and the kernel's products take less time:
the block products and the tied logits at 1-16 rows (few_rows says where it
is the default, by CPU).
A decode step's attention (one query a row) over a float32 cache also takes it
(cached_attention): XLA copies each layer's keys and values out of the cache
before its own small dots; the kernel reads them in place, only the slots a row sees.
A whole sequence's attention (no past: the forward pass, scoring, training) takes attention.cc's op, which has
a gradient (causal_attention), from a library of its own built the same way: see there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Optional

import tensorflow as tf

from .. import quiet
from ..validate import GPT2Error, first_line

# The products' library: matmul.cc (the ops and their products: all a build without XLA compiles), then
# matmul_xla.cc (the ops' XLA kernels); both include HEADER. A whole sequence's attention is a library of its own
# (ATTENTION: no XLA kernel): built apart, it shares no template instance with the products (Eigen's, compiled
# for other register tiles there) and a failed build of one leaves the other.
SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ('matmul.cc', 'matmul_xla.cc'))
HEADER = pathlib.Path(__file__).with_name('matmul.h')
ATTENTION = pathlib.Path(__file__).with_name('attention.cc')
# Each library by name: (its sources, a build without XLA compiling the first alone; the headers they include).
LIBRARIES = {'matmul': (SOURCES, (HEADER,)), 'attention': ((ATTENTION,), ())}
CACHE_ENV = 'GPT2_TF_KERNEL_CACHE'
SWITCH_ENV = quiet.KERNELS_ENV  # 'off': always the TensorFlow ops
ARCH_ENV = 'GPT2_TF_KERNEL_ARCH'  # g++'s -march: 'native' (the default), or e.g. x86-64-v3 for AVX2 and FMA alone
_local = threading.local()  # on this thread: .off inside tensorflow_ops(), .attention_off unless products_only
# From this many rows on, an int8 product is TensorFlow's float32 product over a dequantized copy, by layout
# (transpose_w): a block matrix ([K, N] in panels) whole (at most 41 MB, for 1558M's c_fc), wte
# DEQUANTIZED_ROWS rows at a time (its whole copy would be 154-322 MB). Below, the kernel's tiles (which ask for
# the weights' lines far ahead into L2): three 124M block products took 0.84-0.87x the dequantized copy's time at
# 64-128 rows, 0.94x at 256 and level at 384 (AVX2's code 0.72-0.85x at 64-256, 1.05x at 384; 1.02-1.25x from
# 512 on), and wte's 124M product 0.63-0.84x at 64 rows, 0.84-1.02x at 128, 0.99-1.17x at 256 and 1.02-1.48x at
# 384 (Zen 4, two runs; bench/bench_int8.py --sections rows, in a tf.function and under XLA). So a decode step at
# batch 1-16 and a batch's prompt below 384 tokens in all keep to the int8 bytes. (Before the far lines, the
# tiles' Eigen GEMM path lost to the copy from 64 rows on; 1024 rows of the 124M logits took 294-298 ms so,
# 814-830 in the kernel on an Intel Xeon with oneDNN's product.)
MANY_ROWS = {False: 384, True: 128}
DEQUANTIZED_ROWS = 8192  # rows of wte [n_vocab, n_embd] a dequantized copy holds: 25 MB for 124M, 52 for 1558M
# Rows of x for which a float32 product goes to the kernel by default while decoding, by CPU ('avx512': with
# AVX-512, 'avx2': without) and layout (transpose_w: wte's [N, K]); inside an XLA loop, against XLA's dots
# (bench/bench_products.py). On a Zen 3 (AVX2), with the row groups the bands replaced: the 48 block products
# took 0.97 / 0.65 / 0.65 / 0.80x the time at 2 / 4 / 8 / 16 rows, the tied logits 0.64 / 0.71 / 1.01 / 1.36x;
# the bands took 0.66-0.68x the groups' time at 2-8 rows in AVX2's code on a Zen 4, and 0.60-0.91x XLA's at
# 2-8 rows, 0.91-0.98x at 10. On a Zen 4 (AVX-512): the bands 0.60-0.80x at 2-8 rows, 0.79-0.92x at 10-11 (the
# panels at 12-16 rows level with XLA's dots, and the bands that replaced them there level in whole calls; see
# the Intel lines below), the tied logits 0.58-0.62x at 2 rows,
# 0.65-0.79x at 4, 0.72-0.84x at 8, 0.98-1.10x at 12-16. At one row XLA's matrix-vector product streams the
# weights at the machine's bandwidth: the bands were level with it with AVX-512 and level to 1.3x its time with
# AVX2's code, the logits' tiles 1.3-1.5x. But that loop's products are independent, and XLA overlaps them; in a
# decode step each waits for the last, and XLA fuses the bias into its dot, which then streamed 18 GB/s: with
# AVX-512, whole greedy calls at batch 1 took 0.89-0.91x the time with the block products on the kernel
# (bench/bench_few_rows.py). With AVX2's code on the same Zen 4 0.82-1.16x, so the AVX2 table kept XLA's there
# until the custom calls ran on a team of threads (matmul.cc's Team): since, 0.69-0.84x (five rounds).
# The tied logits at one row take the kernel since its rows of wte are prefetched into L2 (PrefetchRow in
# matmul.cc): 5.0-6.3 ms a step against XLA's 5.3-6.6 (AVX2's code: 4.8-5.1), whole greedy calls at batch 1
# 0.83-0.98x (Zen 4; AVX2's code level to 0.87x).
# On an Intel Xeon with AMX (AVX-512), XLA's dots chained as in a step took 49-55 ms at 8-16 rows, the bands
# 26-35 (0.52-0.64x), and greedy calls at batch 1-8 0.61-0.66x XLA's time: the block products take the bands at
# 12-16 rows on AVX-512 too (level in whole calls on the Zen 4).
# Since wte's tiles ask for its rows far ahead (matmul.cc's kFarChannels), the tied logits take the kernel at
# 9-16 rows too: on the Zen 4 it took 0.51x, 0.60x and 0.70x XLA's time at 9, 12 and 16 rows, with AVX2's code
# 0.77-0.80x and 0.89-0.93x at 12 and 16; whole greedy calls at batch 16 0.71-0.76x the time (AVX2's code
# 0.77-0.81x), the tiles' other gains included (BENCHMARKS.md, Far lines).
FEW_ROWS = {'avx2': {False: range(1, 17), True: range(1, 17)},
            'avx512': {False: range(1, 17), True: range(1, 17)}}


def cache_folder() -> pathlib.Path:
    return pathlib.Path(quiet.cache_folder(CACHE_ENV, 'kernels'))


@functools.lru_cache(maxsize=1)  # read once: few_rows asks for every product traced
def _cpu_key() -> str:
    try:
        flags = next(line for line in open('/proc/cpuinfo') if line.startswith('flags'))
    except (OSError, StopIteration):
        flags = ''
    return flags


def arch() -> str:
    return os.environ.get(ARCH_ENV) or 'native'


def _common_flags() -> list:
    """g++'s flags for every source and the link. TensorFlow's Eigen headers do not build under g++ 12 where the
    CPU has AVX512-FP16 (Intel's Sapphire Rapids and later): the kernel uses no half-precision instruction, so
    Eigen is told there are none."""
    return ['-fPIC', '-O3', f'-march={arch()}', '-U__AVX512FP16__', '-w']


def _library_path(xla: bool, name: str = 'matmul') -> pathlib.Path:
    """The library's file in the cache, keyed by its sources, TensorFlow's version and build flags (another
    install of the same version: its ABI flags and include path), g++'s version and flags, and the CPU."""
    sources, headers = LIBRARIES[name]
    tf_flags = [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    built_with = [tf.__version__, *map(_real, tf_flags), _gxx_version(), *_common_flags(), _cpu_key()]
    digest = hashlib.sha256(b''.join(f.read_bytes() for f in (*sources, *headers)) + '\n'.join(built_with).encode())
    return cache_folder() / f'{name}-{digest.hexdigest()[:16]}{"-xla" if xla else ""}.so'


def _real(flag: str) -> str:
    """A -I or -L flag with its folder's real path: one install reached through a link (a venv linked into
    another folder) is one key, where its build would otherwise be repeated in every such folder."""
    if flag[:2] in ('-I', '-L'):
        return flag[:2] + os.path.realpath(flag[2:])
    return flag


@functools.lru_cache(maxsize=1)
def _gxx_version() -> str:
    try:
        return subprocess.run(['g++', '-dumpfullversion'], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''  # no g++: nothing is built


def _flags(xla: bool, name: str = 'matmul') -> tuple:
    """(g++'s compile flags, its sources, its link flags): TensorFlow's own; with xla, also the headers, the
    source and the library that XLA's custom calls need."""
    flags, links = tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()
    sources = LIBRARIES[name][0]
    if not xla:
        return flags, sources[:1], links
    include = pathlib.Path(tf.sysconfig.get_include()) / 'external'
    extra = [f'-I{include / "highwayhash"}', f'-I{include / "farmhash_archive" / "src"}', '-DGPT2_TF_XLA']
    return [*flags, *extra], sources, [*links, '-l:libtensorflow_cc.so.2']


def _run_all(commands: list) -> None:
    """Runs the commands at once and waits for them all; the first that fails raises CalledProcessError."""
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for command in commands]
    try:
        errors = [process.communicate(timeout=900)[1] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for command, process, error in zip(commands, processes, errors):
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, command, stderr=error)


def _compile(target: pathlib.Path, xla: bool, name: str = 'matmul') -> None:
    """Builds the library into target: each source into an object, all at once (the XLA source's headers alone
    take most of the time), then linked into a temporary file renamed into place."""
    flags, sources, links = _flags(xla, name)
    common = _common_flags()
    with tempfile.TemporaryDirectory(prefix=WORK, dir=target.parent) as work:
        objects = [str(pathlib.Path(work) / (source.stem + '.o')) for source in sources]
        _run_all([['g++', '-c', *common, *flags, str(source), '-o', o] for source, o in zip(sources, objects)])
        partial = str(pathlib.Path(work) / target.name)
        _run_all([['g++', '-shared', *common, *objects, *links, '-o', partial]])
        digest = pathlib.Path(work) / 'digest'
        digest.write_text(_sha256(partial))
        os.replace(digest, target.with_suffix('.sha256'))  # first: a library without its digest is not loaded
        os.replace(partial, target)


def _sha256(path) -> str:
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


def _intact(target: pathlib.Path) -> bool:
    """Whether target is the library its build wrote (a cache folder copied or synced may hold a cut-off one,
    which would crash the process that maps it)."""
    try:
        return target.with_suffix('.sha256').read_text() == _sha256(target)
    except OSError:
        return False


LOCK_NOTICE = 10.0  # seconds waited for another process's build before saying so
LOCK_WAIT = 3600.0  # seconds after which that build is given up on here: TensorFlow's ops run instead
STALE = 3 * 3600.0  # seconds after which a build's work folder left in the cache is a killed build's
WORK = 'gpt2_tf-build-'  # a build's work folder in the cache: its name's start


@contextlib.contextmanager
def _one_builder(target: pathlib.Path):
    """Holds the build's lock file: processes that start together (the test workers, a command line's children)
    build the library once, the others waiting for it, saying so on a terminal after LOCK_NOTICE seconds and
    giving up after LOCK_WAIT (TimeoutError). Holding it, removes the work folders of killed builds. (fcntl is
    POSIX's: imported here, where the build is on Linux, so that the package still imports elsewhere.)"""
    import fcntl

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the folder goes, say: it turns the kernels off, which nothing else would tell
        warnings.warn(f'the kernels\' cache folder {target.parent} cannot be made ({first_line(e)}), so TensorFlow\'s '
                      f'ops run instead: set {CACHE_ENV} to a writable folder', stacklevel=1)
        raise
    path = target.with_suffix('.lock')
    with open(path, 'w') as lock:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited > LOCK_WAIT:
                    raise TimeoutError(f'another process has been building {target.name} for {waited:.0f} s '
                                       f'(it holds {path}); TensorFlow\'s ops run meanwhile') from None
                if waited > LOCK_NOTICE and not told and sys.stderr.isatty():  # someone watching it wait
                    print(f'gpt2_tf: waiting for another process that is building {target.name} ({path})',
                          file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.25)
        quiet.remove_stale(str(target.parent), WORK, STALE)  # a killed build's, which TemporaryDirectory left
        yield


def _load(xla: bool, name: str = 'matmul'):
    """The op library built with (or without) XLA's custom calls, or the reason it is not there (a str)."""
    target = _library_path(xla, name)
    failed = target.with_suffix('.failed')  # a build that failed on its sources is not tried again for this key
    try:
        if not _intact(target):
            with _one_builder(target):
                if failed.exists():
                    return failed.read_text()
                if not _intact(target):
                    try:
                        _compile(target, xla, name)
                    except subprocess.CalledProcessError as e:
                        reason = _failure(e)
                        if _in_the_sources(e):  # written while the lock is held: a waiting builder reads it
                            note = f'{reason} (recorded in {failed}: remove it to build again)'
                            failed.write_text(note)
                            warnings.warn(f'the {name} kernels could not be built, and TensorFlow\'s ops run instead '
                                          f'({note})', stacklevel=2)
                        return reason
        return tf.load_op_library(str(target))
    except FileNotFoundError as e:
        return 'no g++ on this machine' if e.filename == 'g++' else f'the kernel could not be built: {first_line(e)}'
    except (subprocess.TimeoutExpired, OSError) as e:
        return f'the kernel could not be built: {first_line(e)}'
    except tf.errors.OpError as e:
        return f'{target} could not be loaded ({first_line(e)}): remove it to build it again'


def _failure(e: subprocess.CalledProcessError) -> str:
    if e.returncode < 0:  # a signal (the out-of-memory killer, a Ctrl-C): tried again next time
        return f'g++ was killed (signal {-e.returncode}; out of memory?)'
    lines = e.stderr.decode(errors='replace').strip().splitlines() or ['?']
    return 'g++ failed: ' + next((line for line in lines if 'error' in line), lines[-1])


SOURCE_ERROR = re.compile(rb'\.(cc|h):\d+:(\d+:)? (fatal )?error:')  # g++'s own line about a source or a header
TRANSIENT = re.compile(rb'No space left|error writing to|Killed signal|Cannot allocate memory|virtual memory exhausted')


def _in_the_sources(e: subprocess.CalledProcessError) -> bool:
    """Whether g++ failed on the sources (headers XLA's build lacks, say), which the next try fails on too; not
    a full disk, a killed compiler or a linker's I/O, which a later try may get past."""
    return e.returncode > 0 and bool(SOURCE_ERROR.search(e.stderr or b'')) and not TRANSIENT.search(e.stderr or b'')


def _refused() -> Optional[str]:
    """Why no library is built here at all, or None."""
    if not quiet.check_switch(SWITCH_ENV):
        return f'{SWITCH_ENV}={os.environ[SWITCH_ENV]}'
    if not sys.platform.startswith('linux'):
        return 'the kernel is built on Linux only'
    return None


def _checked(library, what: str):
    """library as loaded; a build asked for by name ($GPT2_TF_KERNEL_ARCH) that failed is refused, not skipped."""
    if isinstance(library, str) and os.environ.get(ARCH_ENV):
        remedy = ('give g++ a valid -march value (native, x86-64-v3, ...) or unset it' if 'march' in library
                  else f'unset {ARCH_ENV} to run without it')
        raise GPT2Error(f'{ARCH_ENV}={arch()}: {what} could not be built ({library}); {remedy}')
    return library


@functools.lru_cache(maxsize=1)
def _library() -> tuple:
    """(the loaded products' library or the reason it is not there (a str), whether it holds XLA's custom calls)."""
    if reason := _refused():
        return reason, False
    library = _load(xla=True)
    if not isinstance(library, str):
        return library, True
    return _checked(_load(xla=False), 'the int8 kernel'), False


@functools.lru_cache(maxsize=1)
def _attention_library():
    """The loaded library of a whole sequence's attention (attention.cc), or the reason it is not there (a str)."""
    return _refused() or _checked(_load(xla=False, name='attention'), 'the attention kernel')


def available() -> bool:
    return not isinstance(_library()[0], str)


def xla_available() -> bool:
    """Whether the int8 product also compiles under XLA (the library was built with XLA's headers)."""
    return available() and _library()[1]


def _loaded(what: str = 'the kernel', *, attention: bool = False):
    """The loaded op library (the attention's, or the products'); RuntimeError naming why it is not there."""
    library = _attention_library() if attention else _library()[0]
    if isinstance(library, str):
        raise RuntimeError(f'{what} is not available: {library}')
    return library


def unavailable_reason() -> Optional[str]:
    library = _library()[0]
    return library if isinstance(library, str) else None


@contextlib.contextmanager
def tensorflow_ops(*, products_only: bool = False):
    """Within it, on this thread, products traced with kernel=None use TensorFlow ops (cast, scale, matmul), and
    so does a whole sequence's attention: for graphs another runtime converts (LiteRT keeps the int8 weights as
    int8 constants) or that must load without the op library (SavedModel). products_only=True leaves the
    attention's kernel on, which has a gradient (training: the products' kernels have none)."""
    before = getattr(_local, 'off', False), getattr(_local, 'attention_off', False)
    _local.off, _local.attention_off = True, before[1] or not products_only
    try:
        yield
    finally:
        _local.off, _local.attention_off = before


def decoding_available() -> bool:
    """Whether decoding's products and attention may take the kernel: it is built with XLA's custom calls
    (float32 decodes under XLA by default, where an op without them would not compile), and not inside
    tensorflow_ops() on this thread."""
    return xla_available() and not getattr(_local, 'off', False)


def few_rows(transpose_w: bool) -> range:
    """The rows of x for which a float32 product goes to the kernel while decoding, on this CPU (FEW_ROWS),
    where decoding may take it at all (decoding_available, through precision.kernel_while_decoding)."""
    return FEW_ROWS['avx512' if 'avx512f' in _cpu_key().split() else 'avx2'][transpose_w]


def float_matmul(x, w, *, transpose_w: bool = False):
    """x float32 [M, K] times float32 w [K, N] (or [N, K] with transpose_w, wte's layout) -> [M, N], by the
    kernel (no gradient: training traces inside tensorflow_ops())."""
    return _loaded().gpt2_float_mat_mul(x, w, transpose_w=transpose_w, threads=_threads())


def _threads() -> int:
    """How many threads a product or attention takes when XLA runs it (its custom call): TensorFlow's intra-op
    setting when traced (0: one per CPU this process may use), so that processes sharing a machine's cores
    (Beam's local workers, say) each keep to their share. Outside XLA they run on TensorFlow's own threads."""
    return tf.config.threading.get_intra_op_parallelism_threads()


def cached_attention(q, cache, mask):
    """q float32 [B, H, F] (a decode step's one query a row), cache float32 [B, 2, H, S, F] (a layer's keys and
    values at S slots), mask float32 [B, S] (1 where the row's query sees the slot, else 0) -> the original's
    attention, softmax((q . k) / sqrt(F) masked by -1e10) . v, float32 [B, H, F]; by the kernel (no
    gradient), reading only the slots each row sees."""
    return _loaded().gpt2_cached_attention(q, cache, mask, threads=_threads())


def unpack(w, panel: int):
    """int8 w [K, N] whose values are laid out as panels [N / panel, K, panel] -> the plain [K, N]."""
    k, n = w.shape
    return tf.reshape(tf.transpose(tf.reshape(w, [n // panel, k, panel]), [1, 0, 2]), [k, n])


def int8_matmul(x, w, scale, *, transpose_w: bool = False, panel: int = 0, kernel: Optional[bool] = None):
    """x float32 [M, K] times int8 w with one float32 scale per output channel -> float32 [M, N].

    panel: 0 for w's plain layout; else w [K, N] holds its values as [N / panel, K, panel] (see
    gpt2_tf.precision.pack), so that a block of output channels is one contiguous stream.
    kernel: None uses the C++ kernel when it is available (MANY_ROWS[transpose_w] rows or more take
    TensorFlow's float32 product over a dequantized copy), True requires it, False uses TensorFlow ops.
    """
    if w.dtype != tf.int8:  # the op's own checks, which the TensorFlow ops' path would not make
        raise TypeError(f'int8_matmul: w must be int8, got {w.dtype.name}; quantize it first (gpt2_tf.precision.quantize)')
    if transpose_w and panel:
        raise ValueError('int8_matmul: a transposed w has no panels; pass panel=0 with transpose_w=True')
    # Inside an XLA-compiled function, only a library built with XLA's custom calls runs.
    use = kernel if kernel is not None else (available() and not getattr(_local, 'off', False) and on_cpu(x)
                                             and (xla_available() or not under_xla()))
    if not use:
        return _dequantized_product(x, w, scale, transpose_w, panel)
    dequantized = lambda: _dequantized_product(x, w, scale, transpose_w, panel, DEQUANTIZED_ROWS)  # noqa: E731
    library = _loaded('the int8 kernel')
    tiles = lambda: library.gpt2_int8_mat_mul(x, w, scale, transpose_w=transpose_w, panel=panel,
                                                   threads=_threads())  # noqa: E731
    if kernel:
        return tiles()
    rows = x.shape[0]
    if rows is not None:  # known when traced: one branch, not a tf.cond holding both
        return dequantized() if rows >= MANY_ROWS[transpose_w] else tiles()
    return tf.cond(tf.shape(x)[0] >= MANY_ROWS[transpose_w], dequantized, tiles)


def _dequantized_product(x, w, scale, transpose_w: bool, panel: int, part: Optional[int] = None):
    """The same product in TensorFlow ops: w cast to float32 and scaled, then a float32 matmul; w [N, K] (wte)
    `part` rows at a time where given, their products joined along N (the fallback keeps one copy: exporters
    fold small parts into float32 constants)."""
    if transpose_w:
        part = part or w.shape[0]
        parts = [tf.matmul(x, tf.cast(w[n:n + part], tf.float32) * scale[n:n + part, None], transpose_b=True)
                 for n in range(0, w.shape[0], part)]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
    wide = tf.cast(unpack(w, panel) if panel else w, tf.float32)
    return tf.matmul(x, wide * scale)


def sequence_attention_available(q) -> bool:
    """Whether a whole sequence's attention traced now for q [B, H, T, F] may take the kernel (causal_attention):
    q float32 and on a CPU, the library built, not inside tensorflow_ops() (products_only=True leaves it on),
    and not in an XLA-compiled function (the op has no XLA kernel: there XLA's own ops run)."""
    if q.dtype != tf.float32 or getattr(_local, 'attention_off', False) or under_xla():
        return False  # asked first: where the answer is no, the library is never built
    return on_cpu(q) and attention_available()


def on_cpu(x) -> bool:
    """Whether x is (or, traced, will be) on a CPU: the kernels' ops and XLA custom calls are the CPU's alone.
    Placed by the caller, or by TensorFlow: then only where no other device is there."""
    device = (getattr(x, 'device', '') or '').upper()
    return 'CPU' in device or (not device and all(d.device_type == 'CPU' for d in tf.config.list_logical_devices()))


def attention_available() -> bool:
    """Whether the library of a whole sequence's attention (attention.cc) is built and loaded here."""
    return not isinstance(_attention_library(), str)


def under_xla() -> bool:
    """Whether the graph being traced now is XLA-compiled (tf.function(jit_compile=True) traces inside an XLA
    context: TensorFlow's own test, not a public one; where it is gone, answered yes, so TensorFlow's ops run)."""
    try:
        from tensorflow.python.ops import control_flow_util
        return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except (ImportError, AttributeError):
        return True


def causal_attention(q, k, v):
    """q, k, v float32 [B, H, T, F] of one whole sequence -> the original's attention under its causal mask,
    each query against the keys up to its own position, float32 [B, H, T, F]; by the kernel (attention.cc),
    differentiable (its gradient op recomputes the weights from each query's saved log-sum-exp)."""
    return _loaded(attention=True).gpt2_causal_attention(q, k, v)[0]


@tf.RegisterGradient('Gpt2CausalAttention')
def _causal_attention_gradient(op, da, _):
    """da [B, H, T, F] -> dq, dk, dv. The second output, lse, only this gradient reads (causal_attention
    returns a alone), so it takes no gradient of its own."""
    q, k, v = op.inputs
    return _loaded(attention=True).gpt2_causal_attention_grad(q, k, v, op.outputs[1], da)
