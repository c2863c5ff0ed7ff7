"""Files that ship inside the package: the GPT-2 vocabulary and a tiny test checkpoint."""

from __future__ import annotations

from importlib import resources


def asset(*parts: str) -> str:
    """The path of a file or folder under gpt2_tf/assets."""
    return str(resources.files('gpt2_tf').joinpath('assets', *parts))


def bundled_vocabulary() -> tuple:
    """Paths of the encoder.json and vocab.bpe that ship with the package (OpenAI's, unchanged)."""
    return asset('encoder.json'), asset('vocab.bpe')


def bundled_checkpoint() -> str:
    """A tiny original-format checkpoint with random weights (the real vocabulary, 2 layers), for trying things out."""
    return asset('test-checkpoint')
