"""LoRA: a training step against a reference written here, and the adapter folder against PEFT itself."""

import dataclasses
import errno
import json
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

import gpt2_tf
from gpt2_tf import HParams, load_model, lora, scoring
from gpt2_tf.checkpoint import save_checkpoint
from gpt2_tf.hf import save_hf
from gpt2_tf.tf1_reference import Reference, gpt2_graph
from gpt2_tf.train import Trainer, finetune
from gpt2_tf.train_config import FinetuneConfig
from gpt2_tf.validate import GPT2Error

from conftest import FIXTURES, assert_close, require
from support import write_random_checkpoint

TINY = FIXTURES / 'tf1-tiny'
v1 = tf.compat.v1


def batch(rows=4, length=12, seed=0, n_vocab=512):
    return np.random.default_rng(seed).integers(0, n_vocab, (rows, length)).astype(np.int32)


def test_an_adapted_model_starts_as_its_base():
    model = load_model(TINY)
    tokens = batch(2)
    base = model(tokens)['logits'].numpy()
    adapters = lora.attach(model, rank=4, targets='c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj', seed=1)
    # B is zero: the base, to float32 rounding (an adapted c_fc's GELU runs apart from its product, where
    # oneDNN fuses the base's into it)
    np.testing.assert_allclose(model(tokens)['logits'].numpy(), base, rtol=0, atol=1e-6)
    a = adapters['h.0.attn.c_attn']
    bound = 1 / np.sqrt(32)  # PEFT's kaiming_uniform_(a=sqrt(5)) on [r, nx]: uniform within 1/sqrt(nx)
    assert np.abs(a.A.numpy()).max() <= bound and np.abs(a.A.numpy()).max() > 0.8 * bound
    assert a.scale == 2.0  # alpha defaults to 2 * rank


# --- one step against a reference: the TF1 graph over base + A·B·scale, tf.gradients, TF1 Adam by hand ---

def reference_steps(tokens, a0: dict, b0: dict, *, scale, lr, steps):
    """(losses, A, B) after `steps` TF1 Adam updates of the adapters alone, on the original graph."""
    graph = tf.Graph()
    with graph.as_default():
        X = v1.placeholder(tf.int32, [None, None])
        A = {n: v1.placeholder(tf.float32, a.shape) for n, a in a0.items()}
        B = {n: v1.placeholder(tf.float32, b.shape) for n, b in b0.items()}

        def getter(getter, name, *args, **kwargs):  # model/h0/attn/c_attn/w -> w + A·B·scale
            w = getter(name, *args, **kwargs)
            key = name[len('model/'):-len('/w')].replace('/', '.') if name.endswith('/w') else None
            key = key and key.replace('h', 'h.', 1)
            return w + (A[key] @ B[key] * scale)[None] if key in A else w

        with v1.variable_scope(v1.get_variable_scope(), custom_getter=getter):
            logits = gpt2_graph(HParams.from_json(TINY / 'hparams.json'), X)['logits']
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=X[:, 1:], logits=logits[:, :-1]))
        names = sorted(A)
        grads = tf.gradients(loss, [A[n] for n in names] + [B[n] for n in names])
        session = v1.Session(graph=graph)
        v1.train.Saver(var_list=v1.global_variables()).restore(session, str(TINY / 'model.ckpt'))
    values = {('A', n): a0[n] for n in names} | {('B', n): b0[n] for n in names}
    m = {k: np.zeros_like(v) for k, v in values.items()}
    v = {k: np.zeros_like(x) for k, x in values.items()}
    losses = []
    for t in range(1, steps + 1):
        feed = {X: tokens} | {A[n]: values[('A', n)] for n in names} | {B[n]: values[('B', n)] for n in names}
        out = session.run([loss] + grads, feed)
        losses.append(out[0])
        lr_t = lr * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)  # TF1 Adam: bias correction in the step size
        for key, g in zip([('A', n) for n in names] + [('B', n) for n in names], out[1:]):
            m[key] = 0.9 * m[key] + 0.1 * g
            v[key] = 0.999 * v[key] + 0.001 * g * g
            values[key] = values[key] - lr_t * m[key] / (np.sqrt(v[key]) + 1e-8)
    return losses, values


@pytest.mark.parametrize('accumulate, recompute, loss_rows', [(1, False, 256), (2, True, 256), (1, False, 16)],
                         ids=['plain', 'accumulate2-recompute', 'loss-in-parts'])
def test_lora_steps_equal_the_reference(accumulate, recompute, loss_rows, monkeypatch):
    # loss_rows 16: a step's 44 rows of logits in 3 parts of 15, the last one padded (scoring.frozen_head_loss)
    monkeypatch.setattr(scoring, 'LOSS_ROWS', loss_rows)
    model = load_model(TINY)
    trainer = Trainer(model, 1e-2, 'adam', accumulate, recompute, lora_rank=2, lora_alpha=3.0,
                      lora_targets='c_attn,mlp.c_proj')
    rng = np.random.default_rng(1)  # a fixed start: the bound below holds for it (the tail of random starts
    for a in trainer.adapters.values():  # reaches 8.5e-6 where a gradient is near 0), and the test is repeatable
        a.A.assign(rng.uniform(-1, 1, a.A.shape).astype(np.float32) / np.sqrt(a.A.shape[0]))
    a0 = {n: a.A.numpy() for n, a in trainer.adapters.items()}
    b0 = {n: a.B.numpy() for n, a in trainer.adapters.items()}
    tokens = batch()
    base = {n: v.numpy() for n, v in model.variables_by_name().items() if '/lora/' not in n}
    losses = [trainer.step(tokens) for _ in range(3)]  # step 1 moves B only (A's gradient is 0 while B is)
    ref_losses, ref = reference_steps(tokens, a0, b0, scale=1.5, lr=1e-2, steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # float32 sums in another order
    for n, a in trainer.adapters.items():
        # Adam moves each value about lr a step whatever its gradient's size, so where a gradient is near 0
        # float32 reassociation moves m/sqrt(v): 3e-4 of lr (3e-7 measured); a wrong beta, epsilon, bias
        # correction or scale moves 1e-3 and more.
        np.testing.assert_allclose(a.A.numpy(), ref[('A', n)], atol=3e-6, err_msg=n)
        np.testing.assert_allclose(a.B.numpy(), ref[('B', n)], atol=3e-6, err_msg=n)
        assert np.abs(a.A.numpy() - a0[n]).max() > 1e-3  # both moved
    for name, value in model.variables_by_name().items():
        if '/lora/' not in name:
            np.testing.assert_array_equal(value.numpy(), base[name], err_msg=f'{name} is frozen')


def test_a_run_resumes_with_the_adapter_and_its_slots(tmp_path):
    tokens = batch()
    options = dict(lora_rank=2, lora_dropout=0.2)
    trainer = Trainer(load_model(TINY), 1e-2, 'adam', 2, True, **options)
    trainer.step(tokens)
    trainer.step(tokens)
    trainer.save(str(tmp_path / 'run'))
    files = sorted(os.listdir(tmp_path / 'run'))
    assert 'adapter_model.safetensors' in files and 'optimizer-2.index' in files
    assert not [f for f in files if f.startswith('model')]  # never the base model's files
    expected = trainer.step(tokens)
    resumed = Trainer(load_model(TINY), 1e-2, 'adam', 2, True, **options)
    resumed.restore(str(tmp_path / 'run'))
    assert resumed.steps == 2
    assert resumed.step(tokens) == expected  # the same adapters, moments and dropout masks


def test_finetune_with_lora_writes_peft_files_only(tmp_path):
    chunks = [np.arange(200) % 512]
    finetune(str(TINY), chunks, steps=2, lora_rank=2, checkpoint_dir=str(tmp_path), run_name='r', sample_every=0,
             print_every=0, accumulate_gradients=1, seed=0, log=lambda line: None)
    config = json.loads((tmp_path / 'r' / 'adapter_config.json').read_text())
    assert (config['peft_type'], config['r'], config['lora_alpha'], config['fan_in_fan_out']) == ('LORA', 2, 4, True)
    assert config['target_modules'] == ['attn.c_attn'] and config['base_model_name_or_path'] == str(TINY)
    assert (tmp_path / 'r' / 'counter').read_text().strip() == '2'


def test_a_lora_run_without_safetensors_is_refused_before_its_first_step(tmp_path):
    import subprocess
    import sys

    (tmp_path / 'blocked').mkdir()
    (tmp_path / 'blocked' / 'safetensors.py').write_text('raise ImportError("blocked")\n')  # as if not installed
    (tmp_path / 'corpus.txt').write_text('One two three four five six seven. ' * 40)
    done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'finetune', 'corpus.txt', '--model_name', 'test',
                           '--lora_rank', '2', '--steps', '2', '--sample_every', '0'], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, 'PYTHONPATH': str(tmp_path / 'blocked')}, timeout=300)
    assert done.returncode == 2 and 'loss=' not in done.stdout, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("gpt2-tf: error: LoRA adapters are PEFT's safetensors files, "
                                                    "which need the safetensors package: pip install -e '.[hf]'")
    assert sorted(os.listdir(tmp_path)) == ['blocked', 'corpus.txt']  # no run folder


def test_finetune_trains_adapters_over_int8_weights_and_refuses_full_fine_tuning_of_them(tmp_path):
    chunks = [np.arange(200) % 512]
    options = dict(checkpoint_dir=str(tmp_path), sample_every=0, print_every=0, seed=0, log=lambda line: None)
    trainer = finetune(str(TINY), chunks, steps=1, lora_rank=2, dtype='int8', run_name='q', **options)
    assert trainer.model.dtype == 'int8'
    assert (tmp_path / 'q' / 'adapter_model.safetensors').exists()
    assert not list((tmp_path / 'q').glob('model-*'))  # the int8 base is never written
    with pytest.raises(GPT2Error, match='dtype int8 holds frozen weights, and only LoRA adapters train over them'):
        finetune(str(TINY), chunks, steps=1, dtype='int8', run_name='f', **options)


@pytest.mark.parametrize('bad, message', [
    (dict(lora_rank=-1), r'lora_rank must be an integer >= 0 \(0: off\), got -1'),
    (dict(lora_rank=2, lora_alpha=0), 'lora_alpha must be a finite number > 0, got 0'),
    (dict(lora_rank=2, lora_targets='attn.c_fc'), "lora_targets: no module 'attn.c_fc'; choose from"),
    (dict(lora_rank=2, lora_dropout=1.0), r'lora_dropout must be in \[0, 1\), got 1.0'),
    (dict(lora_rank=2, lora_alpha=-1.0), 'lora_alpha must be a finite number > 0, got -1.0'),
    (dict(lora_rank=2, lora_alpha=float('nan')), 'lora_alpha must be a finite number > 0, got nan'),
    (dict(lora_rank=2, lora_dropout=-0.5), r'lora_dropout must be in \[0, 1\), got -0.5'),
])
def test_lora_options_are_checked(bad, message):
    with pytest.raises(GPT2Error, match=message):
        FinetuneConfig(**bad)
    if bad['lora_rank'] > 0:  # the Trainer, built without a config, by the same check
        model = load_model(TINY)
        with pytest.raises(GPT2Error, match=message):
            Trainer(model, 1e-2, 'adam', 1, False, **bad)
        assert model.h[0].attn.c_attn.adapter is None  # refused before any adapter is attached


# --- against PEFT and transformers --------------------------------------------------------------

@pytest.fixture(scope='module')
def peft_setup(tmp_path_factory, tiny_vocabulary):
    """(our trained run folder, the base as an HF folder) with adapters on every product, B moved."""
    require('peft')
    folder = tmp_path_factory.mktemp('lora')
    model = load_model(TINY)
    trainer = Trainer(model, 0.05, 'adam', 1, False, lora_rank=3, lora_alpha=5.0,
                      lora_targets='c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj')
    for _ in range(3):
        trainer.step(batch())
    trainer.save(str(folder / 'run'))
    save_hf(load_model(TINY), folder / 'hf', vocabulary=tiny_vocabulary)
    return folder, model


def peft_logits(hf_dir, adapter_dir, tokens):
    torch, transformers, peft = require('torch'), require('transformers'), require('peft')
    base = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_an_adapter_trained_here_loads_in_peft(peft_setup):
    folder, adapted = peft_setup
    tokens = batch(2, 16, seed=5)
    theirs = peft_logits(folder / 'hf', folder / 'run', tokens)
    ours = adapted(tokens)['logits'].numpy()
    assert np.abs(ours - load_model(TINY)(tokens)['logits'].numpy()).max() > 1e-2  # the adapter matters
    assert_close(ours, theirs, 'attached adapters vs PEFT')
    assert_close(load_model(TINY, adapter=folder / 'run')(tokens)['logits'], theirs, 'merged vs PEFT')


def test_the_merged_checkpoint_gives_the_adapted_logits_in_the_original_graph(peft_setup, tmp_path):
    folder, _ = peft_setup
    tokens = batch(2, 16, seed=6)
    merged = load_model(TINY, adapter=folder / 'run')
    prefix = save_checkpoint(merged, tmp_path / 'merged')
    reference = Reference(merged.hparams, prefix)(tokens)['logits']
    assert_close(reference, peft_logits(folder / 'hf', folder / 'run', tokens), 'TF1 graph on merged vs PEFT')


@pytest.mark.parametrize('options', [{}, {'use_rslora': True}, {'init_lora_weights': 'orthogonal'}])
def test_an_adapter_made_by_peft_loads_here(peft_setup, tmp_path, options):
    torch, transformers, peft = require('torch'), require('transformers'), require('peft')
    folder, _ = peft_setup
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel.from_pretrained(folder / 'hf')
    config = peft.LoraConfig(r=4, lora_alpha=7, target_modules=['c_attn', 'c_proj'], fan_in_fan_out=True,
                             task_type='CAUSAL_LM', **options)  # rsLoRA scales by alpha / sqrt(r)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'lora_' in name:
                p.copy_(torch.randn_like(p) * 0.3)  # random A and B: B at zero would test nothing
    model.save_pretrained(tmp_path / 'made')
    tokens = batch(2, 16, seed=7)
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ours = load_model(TINY, adapter=tmp_path / 'made')(tokens)['logits']
    assert_close(ours, theirs, 'a PEFT-made adapter here vs PEFT')


# --- adapters that do not fit -------------------------------------------------------------------

def rewrite(src, dst, *, config=None, tensors=None):
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    values = load_file(os.path.join(src, lora.WEIGHTS))
    save_file(tensors(values) if tensors else values, os.path.join(dst, lora.WEIGHTS))
    settings = json.loads(open(os.path.join(src, lora.CONFIG)).read())
    with open(os.path.join(dst, lora.CONFIG), 'w') as f:
        json.dump(config(settings) if config else settings, f)


KEY = 'base_model.model.transformer.h.1.mlp.c_fc.lora_A.weight'
HEAD = {'base_model.model.lm_head.base_layer.weight': np.zeros((512, 32), np.float32),
        'base_model.model.lm_head.lora_A.weight': np.zeros((3, 32), np.float32),
        'base_model.model.lm_head.lora_B.weight': np.zeros((512, 3), np.float32)}


@pytest.mark.parametrize('change, message', [
    (dict(config=lambda c: c | {'r': 4}), r'h\.0\.attn\.c_attn\.lora_A\.weight has shape \[3, 32\], .* need \[4, 32\]'),
    (dict(tensors=lambda t: {k: v for k, v in t.items() if k != KEY}), 'has no ' + KEY.replace('.', r'\.')),
    (dict(tensors=lambda t: t | {KEY: t[KEY][:, :16]}), KEY.replace('.', r'\.') + r' has shape \[3, 16\]'),
    (dict(tensors=lambda t: t | {KEY.replace('h.1', 'h.2'): t[KEY]}), r'h\.2\.mlp.* has no place in this model'),
    (dict(config=lambda c: c | {'target_modules': ['q_proj']}),
     r"target_modules \['q_proj'\] matches no conv1d of a GPT-2 block \(attn.c_attn, "),
    (dict(config=lambda c: c | {'use_dora': True}), 'use_dora=True is not supported'),
    (dict(config=lambda c: c | {'layers_to_transform': 0}), 'layers_to_transform=0 is not supported'),
    (dict(config=lambda c: c | {'lora_bias': True}), 'lora_bias=True is not supported'),
    (dict(config=lambda c: c | {'alora_invocation_tokens': [50256]}), r'alora_invocation_tokens=\[50256\] is not'),
    (dict(config=lambda c: c | {'init_lora_weights': 'pissa'}), "init_lora_weights='pissa' adapts a changed base"),
    (dict(config=lambda c: c | {'use_qalora': True}), 'use_qalora=True is not supported here .*; merge it with PEFT'),
    (dict(config=lambda c: c | {'velora_config': {'rank': 2}}), 'velora_config=.* is not supported here'),
    (dict(config=lambda c: c | {'target_modules': ['transformer.h.0.attn.c_attn']}),
     'adapts attn.c_attn in some blocks only'),
    (dict(config=lambda c: c | {'target_modules': '(attn'}), r"target_modules '\(attn' is not a regular expression"),
    (dict(config=lambda c: c | {'lora_alpha': float('nan')}),  # json reads NaN and Infinity
     r'adapter_config.json: lora_alpha must be a finite number > 0, got nan; write there the alpha'),
    (dict(config=lambda c: c | {'lora_alpha': float('inf')}), r'adapter_config.json: lora_alpha must be .*got inf'),
    (dict(config=lambda c: c | {'r': float('inf')}), r'adapter_config.json: r must be an integer >= 1, got inf'),
    (dict(config=lambda c: c | {'r': 3.5}), r'adapter_config.json: r must be an integer >= 1, got 3.5; write'),
    (dict(config=lambda c: c | {'r': 3.0}), 'r must be an integer >= 1, got 3.0'),  # PEFT builds no float rank
    (dict(config=lambda c: c | {'target_modules': c['target_modules'] + ['lm_head']},
          tensors=lambda t: t | HEAD),  # PEFT's keys for target_modules [..., 'lm_head']
     r'lm_head\.base_layer\.weight: LoRA on the tied head \(lm_head/wte\) or the embeddings is not supported '
     r'here.*; merge it with PEFT'),
    (dict(tensors=lambda t: t | {'base_model.model.transformer.wte.lora_embedding_A': np.zeros((3, 512), 'f4')}),
     r'wte\.lora_embedding_A: LoRA on the tied head'),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_the_tensor(peft_setup, tmp_path, change, message):
    folder, _ = peft_setup
    rewrite(folder / 'run', tmp_path / 'bad', **change)
    with pytest.raises(lora.AdapterError, match=message):
        load_model(TINY, adapter=tmp_path / 'bad')


@pytest.mark.parametrize('targets', [
    ['transformer.h.0.attn.c_attn', 'transformer.h.1.attn.c_attn', 'transformer.h.0.attn.c_proj',
     'transformer.h.1.attn.c_proj', 'transformer.h.0.mlp.c_fc', 'transformer.h.1.mlp.c_fc',
     'transformer.h.0.mlp.c_proj', 'transformer.h.1.mlp.c_proj'],  # how PEFT saves target_modules='all-linear'
    'all-linear',
    r'.*\.(c_attn|c_proj|c_fc)',  # a string is a regular expression of the whole name
    ['c_attn', 'c_proj', 'h.0.mlp.c_fc', 'h.1.mlp.c_fc'],  # names or their last parts
    ['q_proj', 'c_attn', 'c_proj', 'v_proj', 'c_fc'],  # as in PEFT, other architectures' names match nothing here
])
def test_target_modules_match_as_peft_matches_them(peft_setup, tmp_path, targets):
    folder, _ = peft_setup
    rewrite(folder / 'run', tmp_path / 'named', config=lambda c: c | {'target_modules': targets})
    tokens = batch(2, 16, seed=8)
    np.testing.assert_array_equal(load_model(TINY, adapter=tmp_path / 'named')(tokens)['logits'],
                                  load_model(TINY, adapter=folder / 'run')(tokens)['logits'])


@pytest.mark.parametrize('dtype', [np.float32, np.float64])  # float64: read as float32, exactly here
def test_an_adapter_model_bin_loads_as_the_safetensors_does(peft_setup, tmp_path, dtype):
    torch = require('torch')
    from safetensors.numpy import load_file

    folder, _ = peft_setup
    (tmp_path / 'bin').mkdir()
    (tmp_path / 'bin' / lora.CONFIG).write_bytes((folder / 'run' / lora.CONFIG).read_bytes())
    tensors = load_file(folder / 'run' / lora.WEIGHTS)
    torch.save({k: torch.from_numpy(v.astype(dtype)) for k, v in tensors.items()}, tmp_path / 'bin' / 'adapter_model.bin')
    tokens = batch(2, 16, seed=9)
    np.testing.assert_array_equal(load_model(TINY, adapter=tmp_path / 'bin')(tokens)['logits'],
                                  load_model(TINY, adapter=folder / 'run')(tokens)['logits'])


# --- training runs ------------------------------------------------------------------------------------

def test_lora_with_adafactor_stays_finite():
    trainer = Trainer(load_model(TINY), 1e-2, 'adafactor', 1, False, lora_rank=2)
    adapter = trainer.adapters['h.0.attn.c_attn']
    a0 = adapter.A.numpy().copy()
    losses = [trainer.step(batch(seed=step)) for step in range(3)]
    assert np.isfinite(losses).all(), losses
    assert all(np.isfinite(v.numpy()).all() for v in trainer.variables)
    assert np.abs(adapter.A.numpy() - a0).max() > 0  # A moves once B has (its first gradient is zero)


def test_the_seed_draws_the_adapters(tmp_path):
    draws = [Trainer(load_model(TINY), 1e-2, 'adam', 1, False, lora_rank=2, seed=seed).adapters['h.1.attn.c_attn']
             for seed in (3, 3, 4)]
    np.testing.assert_array_equal(draws[0].A.numpy(), draws[1].A.numpy())
    assert np.abs(draws[0].A.numpy() - draws[2].A.numpy()).max() > 0
    options = dict(steps=2, lora_rank=2, lora_dropout=0.2, checkpoint_dir=str(tmp_path), sample_every=0,
                   print_every=0, seed=1, log=lambda line: None)
    runs = [finetune(str(TINY), [np.arange(300) % 512], run_name=name, **options) for name in ('a', 'b')]
    for name in runs[0].adapters:
        np.testing.assert_array_equal(runs[0].adapters[name].B.numpy(), runs[1].adapters[name].B.numpy(), name)


@pytest.mark.parametrize('recompute', [False, True])
def test_each_micro_batch_draws_its_own_dropout_mask(recompute):
    # Two equal rows as two micro-batches: with one mask for both, the step is the one-row step exactly.
    # SGD from B = 0: B's first update is -lr·mean over micro-batches of (dropout(x)·A)ᵀ·dy.
    row = batch(rows=1)
    options = dict(lora_rank=2, lora_dropout=0.5, seed=0)
    steps = {}
    for rows, k, again in ((1, 1, False), (2, 2, False), (2, 2, recompute)):
        trainer = Trainer(load_model(TINY), 1e-1, 'sgd', k, again, **options)
        trainer.step(np.repeat(row, rows, axis=0))
        steps[rows, again] = trainer.adapters['h.0.attn.c_attn'].B.numpy()
    assert np.abs(steps[2, False] - steps[1, False]).max() > 1e-4
    np.testing.assert_allclose(steps[2, recompute], steps[2, False], rtol=1e-5, atol=1e-7)  # recomputed: the same masks


def test_the_targets_order_changes_no_draw(tmp_path):
    tokens = batch()
    losses = {}
    for targets in ('c_attn,mlp.c_fc', 'mlp.c_fc,attn.c_attn'):  # a resume may list them otherwise
        trainer = Trainer(load_model(TINY), 1e-2, 'adam', 1, False, lora_rank=2, lora_dropout=0.3, seed=5,
                          lora_targets=targets)
        losses[targets] = [trainer.step(tokens) for _ in range(2)]
    assert losses['c_attn,mlp.c_fc'] == losses['mlp.c_fc,attn.c_attn']


def test_a_run_folder_of_the_other_kind_is_refused_not_overwritten(tmp_path):
    options = dict(steps=2, checkpoint_dir=str(tmp_path), sample_every=0, print_every=0, seed=0, log=lambda line: None)
    chunks = [np.arange(300) % 512]
    finetune(str(TINY), chunks, run_name='full', **options)
    finetune(str(TINY), chunks, run_name='adapters', lora_rank=2, lora_alpha=4.0, **options)
    with pytest.raises(GPT2Error, match=r'full holds a full fine-tuning run; resume it without --lora_rank'):
        finetune(str(TINY), chunks, run_name='full', lora_rank=2, **options)
    with pytest.raises(GPT2Error, match=r'adapters holds a LoRA run; resume it with its --lora_rank'):
        finetune(str(TINY), chunks, run_name='adapters', **options)
    assert (tmp_path / 'full' / 'counter').read_text().strip() == '2'
    assert (tmp_path / 'adapters' / 'counter').read_text().strip() == '2'
    with pytest.raises(lora.AdapterError, match='lora_alpha 4.0; this run has lora_alpha 16: resume with the same '
                                                'lora options'):
        finetune(str(TINY), chunks, run_name='adapters', lora_rank=2, lora_alpha=16.0, **options)
    with pytest.raises(lora.AdapterError, match=r"rank 2 on \['attn.c_attn'\]; this run trains rank 4 on "
                                                r"\['attn.c_attn'\]: resume with the same lora options"):
        finetune(str(TINY), chunks, run_name='adapters', lora_rank=4, lora_alpha=4.0, **options)  # alpha alike
    with pytest.raises(GPT2Error, match='lora_alpha shapes LoRA adapters, which lora_rank 0 leaves off'):
        finetune(str(TINY), chunks, run_name='adapters', lora_alpha=4.0, **options)  # a full run: alpha unused
    assert (tmp_path / 'adapters' / 'counter').read_text().strip() == '2'


def lora_run(tmp_path, base=TINY, steps=2, **options):
    return finetune(str(base), [np.arange(300) % 512], steps=steps, lora_rank=2, checkpoint_dir=str(tmp_path),
                    run_name='r', sample_every=0, print_every=0, accumulate_gradients=1, save_every=0,
                    log=lambda line: None, **options)


def test_a_lora_run_resumes_on_its_base_by_any_path_and_on_no_other(tmp_path, monkeypatch):
    shutil.copytree(TINY, tmp_path / 'mine')
    os.symlink(tmp_path / 'mine', tmp_path / 'link')
    write_random_checkpoint(tmp_path / 'other', load_model(TINY).hparams, seed=7)  # another base of its sizes
    run = tmp_path / 'r'
    lora_run(tmp_path, base=tmp_path / 'mine', steps=1)
    monkeypatch.chdir(tmp_path)
    for steps, base in enumerate(['mine', tmp_path / 'link'], 2):  # relative, through a symlink
        lora_run(tmp_path, base=base, steps=1)
        assert (run / 'counter').read_text().strip() == str(steps)  # resumed
    with pytest.raises(lora.AdapterError, match=r'r holds adapters for \S+/link, not for \S+/other: resume it with '
                                                r'--model_dir \S+/link, or give --restore_from fresh'):
        lora_run(tmp_path, base=tmp_path / 'other', steps=1)
    assert (run / 'counter').read_text().strip() == '3'
    assert json.loads((run / lora.CONFIG).read_text())['base_model_name_or_path'] == str(tmp_path / 'link')
    lora_run(tmp_path, base=tmp_path / 'other', steps=1, restore_from='fresh')


def test_a_lora_run_resumes_on_another_folder_of_its_published_base(tmp_path):
    shutil.copytree(TINY, tmp_path / 'a' / '124M')  # two downloads of one model, one under its old name
    shutil.copytree(TINY, tmp_path / 'b' / '117M')
    lora_run(tmp_path, base=tmp_path / 'a' / '124M', steps=1)
    lora_run(tmp_path, base=tmp_path / 'b' / '117M', steps=1)
    assert (tmp_path / 'r' / 'counter').read_text().strip() == '2'


def test_a_lora_run_resumed_over_another_dtype_or_a_moved_base_says_so(tmp_path):
    shutil.copytree(TINY, tmp_path / 'base')
    lora_run(tmp_path, base=tmp_path / 'base', steps=1, dtype='int8')
    os.rename(tmp_path / 'base', tmp_path / 'moved')  # cannot be compared: a note, not a refusal
    with pytest.warns(UserWarning) as caught:
        lora_run(tmp_path, base=tmp_path / 'moved', steps=1)
    notes = [str(w.message) for w in caught]
    assert any(re.search(r'r was trained on \S+/base, which is not there now; it resumes on \S+/moved', n)
               for n in notes), notes
    assert any(re.search(r'r trained over int8 base weights up to step 1, and goes on over float32 ones '
                         r'\(--dtype int8 resumes it as it ran\)', n) for n in notes), notes
    assert (tmp_path / 'r' / 'counter').read_text().strip() == '2'


def test_a_failed_lora_save_never_pairs_one_runs_adapter_with_anothers_moments(tmp_path, monkeypatch):
    import safetensors.numpy

    lora_run(tmp_path, seed=0, learning_rate=1e-2)
    run = tmp_path / 'r'
    before = {f.name: f.read_bytes() for f in run.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, 'No space left on device')

    # A fresh run over the folder reaches the same step; its adapter cannot be written: nothing changes.
    monkeypatch.setattr(safetensors.numpy, 'save_file', full)
    with pytest.raises(OSError, match=r'cannot save step 2 in \S+ \(\S+/r/adapter_model.safetensors cannot be '
                                      r'written .*\); the previous checkpoint \(the adapter of step 2\) is intact'):
        lora_run(tmp_path, seed=1, learning_rate=5e-2, restore_from='fresh')
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before
    # Killed after its adapter is in place, before its moments are: the earlier run's moments are gone.
    def killed_at_the_moments(source, prefix, move=gpt2_tf.checkpoint.move_bundle):
        if os.path.basename(prefix) == 'optimizer-2':
            raise OSError(errno.ENOSPC, 'No space left on device')
        move(source, prefix)

    monkeypatch.setattr(gpt2_tf.checkpoint, 'move_bundle', killed_at_the_moments)
    with pytest.raises(OSError, match=r'step 2 is saved in \S+, but writing its optimizer state \(a resume starts the '
                                      r'optimizer afresh\) failed \(No space left'):
        lora_run(tmp_path, seed=1, learning_rate=5e-2, restore_from='fresh')
    monkeypatch.undo()
    assert (run / lora.WEIGHTS).read_bytes() != before[lora.WEIGHTS]
    assert not (run / 'optimizer-2.index').exists() and not list(run.glob('.saving-*'))


def test_an_adapter_whose_config_was_not_replaced_with_it_is_refused(tmp_path, monkeypatch):
    lora_run(tmp_path)  # lora_alpha 4
    replace = os.replace

    def cut_short(source, target):  # killed between the adapter's two files
        if target == os.path.join(tmp_path, 'r', lora.CONFIG):  # the run folder's, not the staged one
            raise OSError(errno.EIO, 'Input/output error')
        replace(source, target)

    monkeypatch.setattr(os, 'replace', cut_short)
    with pytest.raises(OSError, match=r'step 2 is saved in \S+, but writing its adapter_config.json and optimizer '
                                      r'state \(the new adapter is beside the previous step.s config\) failed'):
        lora_run(tmp_path, restore_from='fresh', lora_alpha=64.0)
    monkeypatch.undo()
    with pytest.raises(lora.AdapterError, match=r'was saved with lora_alpha 64.0, but adapter_config.json says 4: a '
                                                r'save cut short'):
        load_model(TINY, adapter=tmp_path / 'r')  # not merged at 4/64 of its scale


def test_an_adapter_goes_only_onto_the_base_its_run_folder_names(tmp_path):
    lora_run(tmp_path)
    other = dataclasses.replace(load_model(TINY).hparams, n_vocab=100, n_head=2)
    write_random_checkpoint(tmp_path / 'other', other)  # the adapters' shapes fit it: n_embd, n_layer alike
    with pytest.raises(lora.AdapterError, match=r'r was trained on a base of HParams\(n_vocab=512, .*not this '
                                                r"model's HParams\(n_vocab=100, .*load it onto the base"):
        load_model(tmp_path / 'other', adapter=tmp_path / 'r')
    load_model(TINY, adapter=tmp_path / 'r')


def test_options_left_off_in_any_spelling_load_and_a_failed_save_is_an_os_error(peft_setup, tmp_path):
    folder, adapted = peft_setup
    rewrite(folder / 'run', tmp_path / 'off', config=lambda c: c | {'use_bdlora': False, 'velora_config': None,
                                                                     'target_parameters': [], 'use_qalora': False})
    tokens = batch(1, 8, seed=3)
    assert_close(load_model(TINY, adapter=tmp_path / 'off')(tokens)['logits'], adapted(tokens)['logits'], 'off')
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / f'{lora.WEIGHTS}.tmp-{os.getpid()}').mkdir()  # the write fails, as on a full disk
    with pytest.raises(OSError, match='adapter_model.safetensors cannot be written'):
        lora.save(str(tmp_path / 'full'), {}, {'peft_type': 'LORA'})
    assert sorted(f.name for f in (tmp_path / 'full').iterdir()) == [f'{lora.WEIGHTS}.tmp-{os.getpid()}']


def test_saved_adapters_and_converted_folders_are_readable_by_others(peft_setup, tmp_path):
    folder, _ = peft_setup
    mask = gpt2_tf.checkpoint.current_umask()
    assert (folder / 'run' / lora.WEIGHTS).stat().st_mode & 0o777 == 0o666 & ~mask
    with gpt2_tf.checkpoint.whole_folder(tmp_path / 'made') as staging:
        pathlib.Path(staging, 'x').write_text('x')
    assert (tmp_path / 'made').stat().st_mode & 0o777 == 0o777 & ~mask



def test_a_lora_run_folder_given_as_the_model_names_its_base_and_adapter(peft_setup):
    folder, _ = peft_setup
    with pytest.raises(FileNotFoundError, match=r'is a LoRA adapter folder, which holds the adapter alone: give '
                                                r'its base model, with --adapter'):
        load_model(folder / 'run')
