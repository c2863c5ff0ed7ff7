import os
import pathlib
import shutil
import signal

import numpy as np
import pytest

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

from gpt2_tf import HParams  # noqa: E402
from support import write_random_checkpoint, write_vocabulary  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'
FIXTURE_NAMES = ['tf1-tiny', 'tf1-tiny-hot']


# float32 against the original graph: the port reaches 1.7e-6 x max(1, max |reference|) on the fixtures
# (XLA on tf1-tiny-hot; 3e-7 on tf1-tiny), from reassociation alone (matmul blocking, fused softmax, graph
# rewrites). 5e-6 stays within 3x of that, so a GELU constant, the mask constant or an epsilon fails.
FLOAT32 = 5e-6
# Elsewhere (other frameworks' kernels, reduced paths) 1e-4 of the largest magnitude, still far under
# what a real defect moves (a dropped bias or gain, a shifted position, the wrong GELU: > 1e-2).
LOOSE = 1e-4


def default_sigint() -> None:
    """For a child process before it starts: Ctrl-C (SIGINT) as a terminal delivers it. A run started as a
    background job of a non-interactive shell ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tolerance(reference, rel: float = LOOSE) -> float:
    return rel * max(1.0, float(np.abs(reference).max()))


def assert_close(actual, reference, what='', *, rel: float = LOOSE):
    actual, reference = np.asarray(actual), np.asarray(reference)
    assert actual.shape == reference.shape, f'{what}: shape {actual.shape} != {reference.shape}'
    diff = float(np.abs(actual - reference).max()) if actual.size else 0.0
    limit = tolerance(reference, rel)
    assert diff <= limit, f'{what}: max |diff| {diff:.3g} > {limit:.3g}'
    return diff


@pytest.fixture(scope='session')
def random_checkpoint(tmp_path_factory):
    """make(hparams, seed=0, scale=0.1) -> folder with an original-format checkpoint of random values."""
    made = {}

    def make(hparams: HParams, seed: int = 0, scale: float = 0.1) -> pathlib.Path:
        key = (hparams, seed, scale)
        if key not in made:
            folder = tmp_path_factory.mktemp('ckpt')
            write_random_checkpoint(folder, hparams, seed=seed, scale=scale)
            made[key] = folder
        return made[key]

    return make


@pytest.fixture(scope='session')
def fixture_vocabulary(tmp_path_factory):
    """make(n_vocab) -> (encoder.json, vocab.bpe) of GPT-2's first n_vocab tokens: what a folder written from a
    fixture carries (the bundled GPT-2 pair holds more tokens than the fixtures have, and is refused there)."""
    made = {}

    def make(n_vocab: int) -> tuple:
        if n_vocab not in made:
            made[n_vocab] = write_vocabulary(tmp_path_factory.mktemp('vocabulary'), n_vocab)
        return made[n_vocab]

    return make


@pytest.fixture(scope='session')
def tiny_vocabulary(fixture_vocabulary) -> tuple:
    """tf1-tiny's: 512 tokens."""
    return fixture_vocabulary(512)


@pytest.fixture
def tiny_with_vocabulary(tmp_path, tiny_vocabulary) -> pathlib.Path:
    """A copy of tf1-tiny that carries its own 512-token vocabulary."""
    folder = tmp_path / 'tf1-tiny'
    shutil.copytree(FIXTURES / 'tf1-tiny', folder)
    for path in tiny_vocabulary:
        shutil.copy(path, folder)
    return folder


@pytest.fixture(params=FIXTURE_NAMES)
def fixture_dir(request) -> pathlib.Path:
    return FIXTURES / request.param


def require(module: str):
    """Imports an optional extra's module, or skips the test module when it is missing.

    Under CI=true a missing extra fails instead: CI installs every extra.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get('CI') == 'true':
            raise ImportError(f'{module} is missing, and CI installs every extra: {e}') from None
        pytest.skip(f'{module} is not installed (an optional extra; pip install -e ".[test]")',
                    allow_module_level=True)
