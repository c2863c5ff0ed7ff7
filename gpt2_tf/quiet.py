"""TensorFlow without its start-up noise, for the command-line tools, with XLA's compiled code kept
across processes (see use_xla_cache).

Importing TensorFlow and initialising its devices prints 6-8 lines from C++
(absl's "All log messages before absl::InitializeLog()", the oneDNN notice,
"Could not find cuda drivers", a failed cuInit) straight to file descriptor 2,
before any Python setting can stop them; TF_CPP_MIN_LOG_LEVEL silences only
the later ones. So the import and device initialisation run with descriptor 2
pointed at a temporary file. The captured text is shown when the import fails,
and always with verbose=True.

TensorFlow's oneDNN ops are turned on (prefer_onednn) wherever TensorFlow loads
through this module, unless TF_ENABLE_ONEDNN_OPTS is set: TensorFlow turns them
on by itself only on CPUs with AVX-512 VNNI, bfloat16 or AMX, and with AVX2
code alone they took a forward pass to 0.61-0.71x and an Adam step to 0.62x of
the time without (BENCHMARKS.md, AVX2 code paths).

The command line calls tensorflow() before it loads a model. A program that
imports gpt2_tf gets the same quiet import through library(), which
`import gpt2_tf` installs: the first `import tensorflow` after it, from
anywhere, runs the same way, unless the program configured TensorFlow's
logging itself (TF_CPP_MIN_LOG_LEVEL set, or TensorFlow imported first).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Optional

# validate is imported where it is used: it imports numpy, and `import gpt2_tf` (this module) stays quick.

_captured = ''
KERNELS_ENV = 'GPT2_TF_KERNELS'  # 'off': always the TensorFlow ops (gpt2_tf.kernels)
XLA_CACHE_ENV = 'GPT2_TF_XLA_CACHE'  # a folder for compiled XLA code, an on word (the default folder), or 'off'
XLA_CACHE_LIMIT = 1 << 30  # bytes kept in the cache folder; the oldest files go first
CPU_FLAGS = ('avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile')


def switch(name: str) -> Optional[bool]:
    """$name read as an on/off setting: False for an off word (validate.OFF), True for an on word (validate.ON)
    or when unset, None for any other value (GPT2_TF_XLA_CACHE's folder, say)."""
    from .validate import ON, is_off

    value = os.environ.get(name, '')
    return False if is_off(value) else True if value.strip().lower() in ON else None


def check_switch(name: str) -> bool:
    """$name as switch() reads it, where it takes no other value (GPT2_TF_KERNELS): GPT2Error for one."""
    from .validate import OFF, ON, GPT2Error

    on = switch(name)
    if on is None:
        raise GPT2Error(f'{name}={os.environ[name]!r} is neither off ({", ".join(OFF)}) nor on '
                        f'({", ".join(filter(None, ON))}): set one, or unset it')
    return on


def cache_folder(env: str, name: str) -> str:
    """$env, else ~/.cache/gpt2_tf/<name>: where the kernels' libraries and tokenizer.json's vocabularies are kept."""
    return os.environ.get(env) or os.path.join(os.path.expanduser('~'), '.cache', 'gpt2_tf', name)


def remove_stale(parent: str, prefix: str, age: float, holding: Optional[set] = None) -> None:
    """Removes the folders in parent whose names start with prefix and that are older than age seconds: the work
    folders of writers killed before they renamed or removed them (a live writer's is younger). With holding, only
    those that hold nothing else (another program's folder of the same name, in a shared cache, stays). A folder
    gone meanwhile, or one that cannot be read, is left to the next writer."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False) and \
                        now - entry.stat(follow_symlinks=False).st_mtime > age and \
                        (holding is None or set(os.listdir(entry.path)) <= holding):
                    shutil.rmtree(entry.path, ignore_errors=True)


def xla_cache_folder() -> Optional[str]:
    """Where compiled XLA code persists across processes, or None when turned off.

    $GPT2_TF_XLA_CACHE (~ expanded), else (or for an on word) ~/.cache/gpt2_tf/xla
    (under $XDG_CACHE_HOME when set), in a subfolder named by the TensorFlow version
    and the CPU's vector flags: compiled code is specific to both, and the cache's
    file names encode neither (the project's machines change CPU class).
    """
    on = switch(XLA_CACHE_ENV)
    if on is False:
        return None
    base = (os.path.expanduser(os.environ[XLA_CACHE_ENV]) if on is None else
            os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'gpt2_tf', 'xla'))
    try:
        from importlib.metadata import version
        tf_version = version('tensorflow')
    except Exception:
        tf_version = 'unknown'
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            flags = set(next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), []))
    except OSError:
        flags = set()
    machine = '-'.join(flag for flag in CPU_FLAGS if flag in flags) or 'cpu'
    return os.path.join(base, f'tf{tf_version}-{machine}')


def use_xla_cache() -> Optional[str]:
    """Points TensorFlow's persistent XLA cache at xla_cache_folder(), before TensorFlow reads its flags.

    Keeps the folder under XLA_CACHE_LIMIT by removing the oldest files. A
    --tf_xla_persistent_cache_directory already in TF_XLA_FLAGS wins.
    """
    if 'tensorflow' in sys.modules or 'tf_xla_persistent_cache_directory' in os.environ.get('TF_XLA_FLAGS', ''):
        return None
    folder = xla_cache_folder()
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        files = sorted((os.path.join(folder, f) for f in os.listdir(folder)), key=os.path.getmtime, reverse=True)
        total = 0
        for path in files:
            total += os.path.getsize(path)
            if total > XLA_CACHE_LIMIT:
                os.remove(path)
    except OSError:
        return None  # an unwritable cache only costs compile time
    # Quoted: XLA's flag parser ends an unquoted value at whitespace (a home folder with a space in its name);
    # inside double quotes a backslash escapes the character after it.
    quoted = folder.replace('\\', '\\\\').replace('"', '\\"')
    os.environ['TF_XLA_FLAGS'] = (os.environ.get('TF_XLA_FLAGS', '') +
                                  f' --tf_xla_persistent_cache_directory="{quoted}"').strip()
    return folder


def xla_cache_on() -> bool:
    """Whether this process keeps compiled XLA code across processes (TF_XLA_FLAGS names a cache folder)."""
    return re.search(r'--tf_xla_persistent_cache_directory=\S', os.environ.get('TF_XLA_FLAGS', '')) is not None


@contextlib.contextmanager
def _stderr_to_file():
    """Points descriptor 2 at a temporary file; yields a function that returns what was written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode='w+b') as sink:
        os.dup2(sink.fileno(), 2)
        text = []
        try:
            yield lambda: ''.join(text)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode('utf-8', errors='replace'))


@contextlib.contextmanager
def _ctrl_c_held():
    """Holds a Ctrl-C (SIGINT) until the end of the block, then raises KeyboardInterrupt, whatever the block
    raised: raised inside TensorFlow's import, the interrupt can come out as another error (AttributeError:
    'tuple' object has no attribute '_type_spec'), a traceback where the command line exits 130. Only where
    Ctrl-C raises KeyboardInterrupt (Python's handler, on the main thread): a program's own handler stays."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt


def _start(load) -> None:
    """Runs load() (TensorFlow's import) and the device initialisation with descriptor 2 captured and Ctrl-C
    held (_ctrl_c_held); what was captured is shown if either fails."""
    global _captured
    read = None
    try:
        with _stderr_to_file() as read, _ctrl_c_held():
            load()
            sys.modules['tensorflow'].config.list_physical_devices()  # device initialisation (cuInit) prints too
    except KeyboardInterrupt:  # Ctrl-C while TensorFlow loads: its start-up lines say nothing about that
        raise
    except BaseException:
        sys.stderr.write(read() if read else '')
        raise
    _captured = read()


def prefer_onednn(on: bool = True) -> None:
    """TensorFlow's oneDNN ops on (or off) for the import to come, unless TF_ENABLE_ONEDNN_OPTS is set."""
    os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '1' if on else '0')


def tensorflow(*, verbose: bool = False, onednn: bool = True):
    """The tensorflow module, imported and its devices initialised without printing anything.

    onednn says whether TensorFlow's oneDNN ops are on, unless TF_ENABLE_ONEDNN_OPTS is set (see
    prefer_onednn); off where that is measured to pay: see gpt2_tf.cli.common.open_model.
    """
    _uninstall()
    if 'tensorflow' in sys.modules:
        return sys.modules['tensorflow']
    use_xla_cache()
    prefer_onednn(onednn)
    # The C++ log lines after start-up too (oneDNN's fallback notices come as errors); --verbose shows them.
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '0' if verbose else '3')
    _start(lambda: importlib.import_module('tensorflow'))
    if verbose:
        sys.stderr.write(_captured)
    tf = sys.modules['tensorflow']
    tf.get_logger().setLevel('ERROR')  # retracing and deprecation warnings
    return tf


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's own loader, run as tensorflow() runs it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # TensorFlow sees its own loader
        os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
        logger = logging.getLogger('tensorflow')
        chosen = logger.level != logging.NOTSET or bool(logger.handlers)  # before TensorFlow adds its handler
        _start(lambda: self.loader.exec_module(module))
        if not chosen:  # retracing and deprecation warnings, as the command line hides them
            logger.setLevel(logging.ERROR)


class _QuietImport(importlib.abc.MetaPathFinder):
    """Finds TensorFlow, the first time anything imports it, with _QuietLoader around its loader."""

    def find_spec(self, name, path=None, target=None):
        if name != 'tensorflow':
            return None
        _uninstall()
        prefer_onednn()
        if 'TF_CPP_MIN_LOG_LEVEL' in os.environ:  # the program chose what TensorFlow prints
            return None
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _QuietLoader(spec.loader)
        return spec


def library() -> None:
    """Makes TensorFlow's first import, whoever makes it, as quiet as the command line's (see above)."""
    if 'tensorflow' not in sys.modules and not any(isinstance(f, _QuietImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport())


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _QuietImport)]


def startup_log() -> str:
    """What TensorFlow printed while it started, as captured by tensorflow()."""
    return _captured


def check_device(device) -> None:
    """Raises GPT2Error when device (e.g. '/GPU:0') names no visible device."""
    from .validate import GPT2Error

    if not device:
        return
    tf = tensorflow()
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError:
        raise GPT2Error(f"device {device!r} is not a device name; use e.g. '/GPU:0' or '/CPU:0'") from None
    kind = (spec.device_type or 'CPU').upper()
    found = tf.config.list_logical_devices(kind)
    if len(found) <= (spec.device_index or 0):
        seen = ', '.join(d.name for d in tf.config.list_logical_devices()) or 'none'
        raise GPT2Error(f'no {device} visible (this machine has: {seen}); drop the device (--device) to run on '
                        f'what there is')
