"""Parameter accounting, named block states, and the block-by-block diff against the TF1 graph."""

import json
import shutil

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf import HParams
from gpt2_tf.cli import main
from gpt2_tf.diagnostics import STATE_NAMES, compare, format_table, parameter_table, trace
from gpt2_tf.tf1_reference import Reference

from conftest import FIXTURES, assert_close


def test_accounting_equals_tensor_counts_on_fixtures(fixture_dir):
    table = parameter_table(fixture_dir)
    assert table['mismatches'] == []
    assert all(row['match'] for row in table['rows'])
    model = gpt2_tf.load_model(fixture_dir)
    assert table['total_expected'] == table['total_checkpoint'] == sum(v.shape.num_elements() for v in model.variables)


@pytest.mark.slow
def test_accounting_on_124m_shapes(random_checkpoint):
    table = parameter_table(random_checkpoint(HParams.named('124M'), scale=0.02))
    rows = {row['component']: row for row in table['rows']}
    groups = {g['group']: g for g in table['groups']}
    assert rows['ln_1']['per_instance'] == 1_536 and rows['ln_1']['expected'] == 18_432
    assert groups['mlp']['per_instance'] == 4_722_432
    assert table['total_expected'] == table['total_checkpoint'] == 124_439_808
    assert table['mismatches'] == []


def test_disagreement_is_flagged(tmp_path):
    folder = tmp_path / 'tiny'
    shutil.copytree(FIXTURES / 'tf1-tiny', folder)
    (folder / 'hparams.json').chmod(0o644)
    HParams(n_vocab=512, n_ctx=64, n_embd=32, n_head=4, n_layer=2).to_json(folder / 'hparams.json')
    table = parameter_table(folder)
    assert table['mismatches'] == ['wpe: model/wpe is [32, 32], the hparams give [64, 32]']
    assert 'wpe[64,32]' in format_table(table) and 'MISMATCH' in format_table(table)


def test_inspect_cli_json(capsys):
    assert main(['inspect', str(FIXTURES / 'tf1-tiny-hot'), '--json']) == 0
    table = json.loads(capsys.readouterr().out)
    assert table['total_expected'] == table['total_checkpoint'] == parameter_table(FIXTURES / 'tf1-tiny-hot')['total_checkpoint']


def test_traced_states_satisfy_residual_identities_and_match_tf1(fixture_dir):
    model = gpt2_tf.load_model(fixture_dir)
    tokens = np.load(fixture_dir / 'reference.npz')['tokens']
    ours = trace(model, tokens, attention_weights=True)
    theirs = Reference(model.hparams, str(fixture_dir / 'model.ckpt')).trace(tokens)
    assert len(ours) == model.hparams.n_layer
    for n, (mine, ref) in enumerate(zip(ours, theirs)):
        assert set(mine) == set(STATE_NAMES) | {'attn_weights'}
        np.testing.assert_array_equal(mine['x_attn'], mine['x'] + mine['attn'])  # x'_n = x_n + attention delta
        np.testing.assert_array_equal(mine['out'], mine['x_attn'] + mine['mlp'])  # x_{n+1} = x'_n + mlp delta
        if n + 1 < len(ours):
            np.testing.assert_array_equal(ours[n + 1]['x'], mine['out'])
        np.testing.assert_allclose(mine['attn_weights'].sum(-1), 1, atol=1e-5)  # softmax rows
        for name in mine:
            assert_close(mine[name], ref[name], f'h{n} {name}')


def test_compare_is_clean_on_an_honest_model():
    report = compare(FIXTURES / 'tf1-tiny-hot', np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens'][:2])
    assert report['first_divergence'] is None
    assert len(report['rows']) == 3 * 8 + 1


@pytest.mark.parametrize('variable, block, state', [
    ('model/h1/ln_2/g', 'h1', 'z2'),
    ('model/h0/attn/c_attn/w', 'h0', 'attn_weights'),
    ('model/h2/mlp/c_proj/b', 'h2', 'mlp'),
    ('model/ln_f/b', 'ln_f', 'logits'),
])
def test_compare_points_at_a_corrupted_variable(variable, block, state):
    model = gpt2_tf.load_model(FIXTURES / 'tf1-tiny-hot')
    target = model.variables_by_name()[variable]
    target.assign(target * 1.01)
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens'][:2]
    report = compare(FIXTURES / 'tf1-tiny-hot', tokens, model=model)
    assert report['first_divergence'] == {'block': block, 'state': state}


def test_compare_checks_the_attention_the_model_runs(monkeypatch):
    """The states come from the model's own attention (the kernel, or the parts of a long sequence), not from
    the original's formula computed beside it for the recorded weights: a fault there is found at its block."""
    from gpt2_tf import model as graph

    attend = graph.Past.attend
    monkeypatch.setattr(graph.Past, 'attend', lambda self, q, k, v: (lambda a, p: (a * 1.01, p))(
        *attend(self, q, k, v)))
    tokens = np.load(FIXTURES / 'tf1-tiny-hot' / 'reference.npz')['tokens'][:2]
    report = compare(FIXTURES / 'tf1-tiny-hot', tokens)
    assert report['first_divergence'] == {'block': 'h0', 'state': 'attn'}


def test_compare_takes_a_model_name_and_refuses_an_hf_folder(tmp_path):
    tokens = [[464, 2068, 7586]]
    assert compare('test', tokens)['first_divergence'] is None  # the bundled checkpoint, by name
    gpt2_tf.save_hf(gpt2_tf.load_model('test'), tmp_path / 'hf')
    with pytest.raises(ValueError, match='is a Hugging Face folder; the TF1 graph reads the original layout'):
        compare(tmp_path / 'hf', tokens)


def test_compare_cli(capsys, monkeypatch):
    assert main(['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '1 2 3 4 5 6']) == 0
    out = capsys.readouterr().out
    assert 'all states within tolerance' in out and 'h1     z2' in out
    from gpt2_tf import model as graph

    attend = graph.Past.attend
    monkeypatch.setattr(graph.Past, 'attend', lambda self, q, k, v: (lambda a, p: (a * 1.01, p))(
        *attend(self, q, k, v)))
    with pytest.raises(SystemExit) as exited:  # a state past tolerance: status 1, as the README says
        main(['compare', str(FIXTURES / 'tf1-tiny'), '--tokens', '1 2 3 4 5 6'])
    assert exited.value.code == 1 and 'h0' in capsys.readouterr().out


def test_a_tensor_of_the_right_size_but_the_wrong_shape_is_flagged(monkeypatch):
    from gpt2_tf import loading

    stored = loading.stored_shapes
    monkeypatch.setattr(loading, 'stored_shapes', lambda folder: {**stored(folder), 'model/h0/mlp/c_fc/w': (128, 32)})
    table = parameter_table(FIXTURES / 'tf1-tiny')  # [1, 32, 128] transposed: as many values, laid out otherwise
    assert table['mismatches'] == ['mlp.c_fc: model/h0/mlp/c_fc/w is [128, 32], the hparams give [1, 32, 128]']
    assert 'MISMATCH' in format_table(table)


def test_a_missing_tensor_and_training_state_are_named_with_the_next_step(monkeypatch):
    from gpt2_tf import loading

    stored = loading.stored_shapes(FIXTURES / 'tf1-tiny')
    del stored['model/h1/ln_1/g']
    stored['model/wte/Adam'] = stored['model/wte']
    monkeypatch.setattr(loading, 'stored_shapes', lambda folder: stored)
    assert parameter_table(FIXTURES / 'tf1-tiny')['mismatches'] == [
        'ln_1: model/h1/ln_1/g is missing from the checkpoint',
        '1 checkpoint variable(s) outside the model: model/wte/Adam (training state, or a head GPT-2 does not have? '
        'the commands that load it pass over it with --no_strict)']


def test_an_unseeded_reference_sampler_stays_unseeded_after_a_seeded_one():
    from gpt2_tf.checkpoint import find_checkpoint

    context, drawn = np.array([[1, 2, 3]], np.int32), []
    for _ in range(2):  # two graphs built alike: a seed carried over would make them draw alike
        reference = Reference(HParams.from_json(FIXTURES / 'tf1-tiny' / 'hparams.json'),
                              find_checkpoint(FIXTURES / 'tf1-tiny'))
        try:
            reference.sampler(length=4, batch_size=1, seed=3)(context)
            drawn.append(reference.sampler(length=20, batch_size=1, top_k=0, seed=None)(context).tolist())
        finally:
            reference.close()
    assert drawn[0] != drawn[1]
