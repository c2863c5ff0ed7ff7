"""LoRA beside saving and precision: adapters written merged, merged before rounding, trained over int8 weights."""

import json
import shutil

import numpy as np
import pytest

from gpt2_tf import load_model, lora
from gpt2_tf.checkpoint import CheckpointError, checkpoint_shapes, save_checkpoint, variable_shapes
from gpt2_tf.hf import HFFormatError, read_tensors, save_hf
from gpt2_tf.tf1_reference import Reference
from gpt2_tf.train import Trainer

from conftest import FIXTURES, assert_close, require

TINY = FIXTURES / 'tf1-tiny'
TARGETS = 'c_attn,mlp.c_proj'


def batch(rows=2, length=12, seed=0):
    return np.random.default_rng(seed).integers(0, 512, (rows, length)).astype(np.int32)


def trained(model, steps=3):
    """A LoRA Trainer on the model after a few steps, so that B (and so A·B) is far from zero."""
    trainer = Trainer(model, 5e-2, 'adam', 1, False, lora_rank=2, lora_targets=TARGETS)
    for _ in range(steps):
        trainer.step(batch())
    return trainer


@pytest.fixture(scope='module')
def run(tmp_path_factory, tiny_vocabulary):
    """(a LoRA run folder trained here, the base as an HF folder, the run's merged float32 checkpoint)."""
    require('safetensors')
    folder = tmp_path_factory.mktemp('lora-save')
    trainer = trained(load_model(TINY))
    trainer.save(str(folder / 'run'))
    save_checkpoint(trainer.model, folder / 'merged')  # from the attached adapters, not through loading
    save_hf(load_model(TINY), folder / 'hf', vocabulary=tiny_vocabulary)
    return folder


# --- saving a model whose adapters are still attached --------------------------------------------

def test_save_checkpoint_mid_training_writes_the_merged_weights(tmp_path):
    model = load_model(TINY)
    trainer = trained(model)
    tokens = batch(seed=3)
    adapted = model(tokens)['logits'].numpy()
    assert np.abs(adapted - load_model(TINY)(tokens)['logits'].numpy()).max() > 1e-2  # the adapters matter
    prefix = save_checkpoint(model, tmp_path / 'merged')
    assert set(checkpoint_shapes(prefix)) == set(variable_shapes(model.hparams))  # no /lora/ variable
    # The original TF1 graph on the file: x·(w + A·B·s) there, x·w + x·A·B·s here (float32 sums reassociated)
    assert_close(Reference(model.hparams, prefix)(tokens)['logits'], adapted, 'TF1 graph on the saved file')
    np.testing.assert_array_equal(model(tokens)['logits'].numpy(), adapted)  # still attached, unchanged
    trainer.step(batch())  # and training goes on


def test_save_hf_mid_training_writes_the_merged_weights(tmp_path, tiny_vocabulary):
    require('safetensors')
    model = load_model(TINY)
    trained(model)
    tokens = batch(seed=4)
    save_hf(model, tmp_path / 'hf', vocabulary=tiny_vocabulary)
    assert not [k for k in read_tensors(tmp_path / 'hf') if 'lora' in k]
    assert_close(load_model(tmp_path / 'hf')(tokens)['logits'], model(tokens)['logits'], 'HF folder reloaded')


def test_bfloat16_adapters_are_saved_merged_in_float32(tmp_path):
    model = load_model(TINY, dtype='bfloat16')
    trained(model)
    tokens = batch(seed=5)
    prefix = save_checkpoint(model, tmp_path / 'merged')
    # bfloat16 products here, float32 ones in the TF1 graph over the same (bfloat16-valued) base: 1e-2 of
    # the largest logit covers bfloat16's 8-bit mantissa on these 2-layer logits; a dropped adapter moves more.
    saved = Reference(model.hparams, prefix)(tokens)['logits']
    assert_close(model(tokens)['logits'], saved, 'bfloat16 model vs its saved file', rel=1e-2)
    base = Reference(model.hparams, str(TINY / 'model.ckpt'))(tokens)['logits']
    assert np.abs(saved - base).max() > 0.1


# --- merging before rounding, and int8 -------------------------------------------------------------

@pytest.mark.parametrize('dtype', ['int8', 'bfloat16'])
@pytest.mark.parametrize('base', ['original', 'hf'])
def test_an_adapter_is_merged_in_float32_then_rounded(run, dtype, base):
    tokens = batch(seed=6)
    folder = TINY if base == 'original' else run / 'hf'
    ours = load_model(folder, adapter=run / 'run', dtype=dtype)(tokens)['logits'].numpy()
    # The merged float32 file (checked against the TF1 graph above), rounded once on loading: the same numbers.
    expected = load_model(run / 'merged', dtype=dtype)(tokens)['logits'].numpy()
    np.testing.assert_array_equal(ours, expected)
    assert np.abs(ours - load_model(folder, dtype=dtype)(tokens)['logits'].numpy()).max() > 1e-2  # not the base


def test_an_hf_folder_loads_in_int8(run):
    tokens = batch(seed=7)
    model = load_model(run / 'hf', dtype='int8')
    assert model.wte.dtype.name == 'int8' and float(np.abs(model.wte_scale.numpy() - 1).max()) > 0  # quantized
    np.testing.assert_array_equal(model(tokens)['logits'].numpy(),
                                  load_model(TINY, dtype='int8')(tokens)['logits'].numpy())


def test_an_int8_model_is_not_saved_and_takes_no_adapter_after_loading(run, tmp_path):
    model = load_model(TINY, dtype='int8')
    with pytest.raises(HFFormatError, match=r'^an int8 model cannot be saved as an HF folder.*dtype="float32"') as e:
        save_hf(model, tmp_path / 'hf')
    assert '\n' not in str(e.value)
    with pytest.raises(CheckpointError, match='int8'):
        save_checkpoint(model, tmp_path / 'ckpt')
    with pytest.raises(lora.AdapterError, match=r'not int8 ones: load the base with load_model\(base, adapter='):
        lora.apply(model, run / 'run')


# --- LoRA over frozen int8 weights -----------------------------------------------------------------

def dequantized(value, axis_kept):
    """The int8 rule written here: per output channel, scale = max|w| / 127, round to nearest -> float32."""
    axes = tuple(i for i in range(value.ndim) if i != axis_kept)
    scale = np.abs(value).max(axis=axes, keepdims=True) / np.float32(127)
    return (np.rint(value / scale) * scale).astype(np.float32)


def test_lora_over_int8_weights_steps_as_over_their_float32_values():
    int8 = load_model(TINY, dtype='int8')
    plain = load_model(TINY)  # float32, holding the int8 weights' values
    for name, variable in plain.variables_by_name().items():
        if name.endswith('/w') or name == 'model/wte':  # conv1d w [1, nx, nf]: a scale per column; wte per row
            variable.assign(dequantized(variable.numpy(), 0 if name == 'model/wte' else 2))
    trainers = [Trainer(m, 5e-2, 'adam', 2, True, lora_rank=2, lora_targets=TARGETS) for m in (int8, plain)]
    for a, b in zip(trainers[0].adapters.values(), trainers[1].adapters.values()):
        b.A.assign(a.A)  # the same start
    losses = [[t.step(batch(4, seed=s)) for s in range(3)] for t in trainers]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)  # float32 sums in another order
    for name, a in trainers[0].adapters.items():
        b = trainers[1].adapters[name]
        np.testing.assert_allclose(a.B.numpy(), b.B.numpy(), atol=3e-6, err_msg=name)  # as test_lora's bound
        np.testing.assert_allclose(a.A.numpy(), b.A.numpy(), atol=3e-6, err_msg=name)
    assert int8.h[0].attn.c_attn.w.dtype.name == 'int8'  # the frozen weights stayed int8


@pytest.mark.parametrize('to', ['original', 'hf'])
def test_convert_with_an_adapter_keeps_the_sources_own_vocabulary(run, tmp_path, tiny_vocabulary, to):
    """--adapter lets a folder convert to its own layout; its vocabulary files are then the ones it has."""
    from gpt2_tf.cli import main

    source = tmp_path / 'source'
    shutil.copytree(TINY if to == 'original' else run / 'hf', source)
    names = ('encoder.json', 'vocab.bpe') if to == 'original' else ('vocab.json', 'merges.txt')
    vocabulary = json.loads(open(tiny_vocabulary[0], encoding='utf-8').read())
    swapped = [token for token, i in vocabulary.items() if i in (300, 301)]
    vocabulary[swapped[0]], vocabulary[swapped[1]] = vocabulary[swapped[1]], vocabulary[swapped[0]]  # its own
    (source / names[0]).write_text(json.dumps(vocabulary))
    shutil.copy(tiny_vocabulary[1], source / names[1])
    assert main(['convert', str(source), str(tmp_path / 'out'), '--to', to, '--adapter', str(run / 'run')]) == 0
    for name in names:
        assert (tmp_path / 'out' / name).read_bytes() == (source / name).read_bytes(), name
