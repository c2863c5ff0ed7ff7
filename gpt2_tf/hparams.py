"""Model hyperparameters: the five numbers in every published hparams.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from .assets import bundled_checkpoint
from .validate import GPT2Error, replacing, shown


HF_CONFIG = 'config.json'
HF_WEIGHTS = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin')  # what gpt2_tf.hf reads
HF_MODEL_FILES = (*HF_WEIGHTS, 'pytorch_model.bin.index.json', 'tf_model.h5', 'flax_model.msgpack')  # any HF save's


def is_hf_folder(path) -> bool:
    """A Hugging Face folder: its settings in config.json, and no hparams.json (the original layout wins)."""
    return os.path.isfile(os.path.join(path, HF_CONFIG)) and not os.path.isfile(os.path.join(path, 'hparams.json'))


def holds_hf_model(path) -> bool:
    """An HF folder with weights in it (any save_pretrained's, those gpt2_tf.hf does not read too): a model, not a
    stray config.json."""
    return is_hf_folder(path) and any(os.path.isfile(os.path.join(path, name)) for name in HF_MODEL_FILES)


@dataclasses.dataclass(frozen=True)
class HParams:
    n_vocab: int  # tokens in the vocabulary (50257 for every published model)
    n_ctx: int  # the longest sequence the model sees: rows in wpe
    n_embd: int  # width of the residual stream
    n_head: int  # attention heads; each sees n_embd // n_head features
    n_layer: int  # transformer blocks, h0 .. h{n_layer-1}

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise GPT2Error(f'hparams: {field.name} must be an integer, got {shown(value)}')
            if value <= 0:
                raise GPT2Error(f'hparams: {field.name} must be positive, got {value}')
        if self.n_embd % self.n_head:
            raise GPT2Error(
                f'hparams: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})')

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = 'hparams') -> 'HParams':
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        missing = [n for n in names if n not in values]
        if unknown:
            raise GPT2Error(f'{source}: unknown key(s) {unknown}; expected exactly {names}: remove them (the '
                            f'original code refuses them too)')
        if missing:
            raise GPT2Error(f'{source}: missing key(s) {missing}; expected exactly {names}: add them with the '
                            f'values of the model the checkpoint holds')
        try:
            return cls(**values)
        except GPT2Error as e:
            raise GPT2Error(f'{source}: {e}'.replace('hparams: ', '')) from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> 'HParams':
        path = os.fspath(path)
        try:
            with open(path, encoding='utf-8') as f:
                values = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f'no hparams.json at {path}') from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # a binary file fails as UTF-8 first
            raise GPT2Error(f'{path}: not valid JSON ({e}); is it the model\'s hparams.json?') from None
        if not isinstance(values, dict):
            raise GPT2Error(f'{path}: expected a JSON object, got {type(values).__name__}')
        return cls.from_dict(values, source=path)

    @classmethod
    def named(cls, name: str) -> 'HParams':
        """The published sizes by name: '124M', '355M', '774M', '1558M' (or '117M', '345M')."""
        key = OLD_NAMES.get(name, name)
        if key not in PUBLISHED:
            raise GPT2Error(f'unknown model size {name!r}; known: {sorted(PUBLISHED, key=len)}')
        return PUBLISHED[key]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str | os.PathLike) -> None:
        """Writes the file whole or not at all (validate.replacing)."""
        with replacing(path) as temporary, open(temporary, 'w', encoding='utf-8') as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write('\n')


PUBLISHED = {
    '124M': HParams(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12),
    '355M': HParams(n_vocab=50257, n_ctx=1024, n_embd=1024, n_head=16, n_layer=24),
    '774M': HParams(n_vocab=50257, n_ctx=1024, n_embd=1280, n_head=20, n_layer=36),
    '1558M': HParams(n_vocab=50257, n_ctx=1024, n_embd=1600, n_head=25, n_layer=48),
}

# The first two models were renamed after release; the old names still appear in scripts.
OLD_NAMES = {'117M': '124M', '345M': '355M'}
BUNDLED = 'test'  # the bundled checkpoint's name, accepted wherever a model name is


def folder_names(path: str) -> tuple:
    """A folder's name, and the published name it stands for ('117M' is 124M's old name), or 'test' for
    the bundled checkpoint."""
    own = os.path.basename(os.path.normpath(path))
    if os.path.realpath(path) == os.path.realpath(bundled_checkpoint()):
        return own, BUNDLED
    names = [own]
    if OLD_NAMES.get(own, own) in PUBLISHED:
        names.append(OLD_NAMES.get(own, own))
    return tuple(dict.fromkeys(names))
