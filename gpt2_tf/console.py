"""The gpt2-tf command's entry point: Ctrl-C while the command line itself loads (numpy, the parsers) exits
130 as it does later, before gpt2_tf.cli.main's own handler is in place."""

from __future__ import annotations


def main() -> int:
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        return 130
    return run()
