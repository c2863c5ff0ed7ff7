"""TensorFlow without its start-up noise, for the command-line tools.

Importing TensorFlow and initialising its devices prints 6-8 lines from C++
(absl's "All log messages before absl::InitializeLog()", the oneDNN notice,
"Could not find cuda drivers", a failed cuInit) straight to file descriptor 2,
before any Python setting can stop them; TF_CPP_MIN_LOG_LEVEL silences only
the later ones. So the import and device initialisation run with descriptor 2
pointed at a temporary file. The captured text is shown when the import fails,
and always with verbose=True. oneDNN stays on: turning it off to hide its
notice would change numerics and speed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

_captured = ''


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


def tensorflow(*, verbose: bool = False):
    """The tensorflow module, imported and its devices initialised without printing anything."""
    global _captured
    if 'tensorflow' in sys.modules:
        return sys.modules['tensorflow']
    # The C++ log lines after start-up too (oneDNN's fallback notices come as errors); --verbose shows them.
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '0' if verbose else '3')
    read = None
    try:
        with _stderr_to_file() as read:
            import tensorflow as tf

            tf.config.list_physical_devices()  # device initialisation (cuInit) prints too
    except BaseException:
        sys.stderr.write(read() if read else '')
        raise
    _captured = read()
    if verbose:
        sys.stderr.write(_captured)
    tf.get_logger().setLevel('ERROR')  # retracing and deprecation warnings
    return tf


def startup_log() -> str:
    """What TensorFlow printed while it started, as captured by tensorflow()."""
    return _captured


def check_device(device) -> None:
    """Raises ValueError when device (e.g. '/GPU:0') names no visible device."""
    if not device:
        return
    tf = tensorflow()
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError:
        raise ValueError(f"--device {device!r} is not a device name; use e.g. '/GPU:0' or '/CPU:0'") from None
    kind = (spec.device_type or 'CPU').upper()
    found = tf.config.list_logical_devices(kind)
    if len(found) <= (spec.device_index or 0):
        seen = ', '.join(d.name for d in tf.config.list_logical_devices()) or 'none'
        raise ValueError(f'no {device} visible (this machine has: {seen}); drop --device to run on what there is')
