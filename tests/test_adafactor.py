"""Adafactor: the Trainer's steps against Algorithm 4 of Shazeer and Stern (2018) written here in numpy, over
the original TF1 graph's gradients."""

import numpy as np
import tensorflow as tf

from gpt2_tf import HParams, kernels, load_model
from gpt2_tf.tf1_reference import gpt2_graph
from gpt2_tf.train import Trainer

from conftest import FIXTURES

TINY = FIXTURES / 'tf1-tiny'
v1 = tf.compat.v1


def adafactor(w, g, state, t, lr):
    """One step without a first moment: decay 1 - t^-0.8, eps1 1e-30, update clipped to RMS 1."""
    decay = 1 - t ** -0.8
    g2 = g.astype(np.float64) ** 2 + 1e-30
    if w.ndim >= 2:
        state['r'] = decay * state.get('r', 0) + (1 - decay) * g2.mean(axis=-1)
        state['c'] = decay * state.get('c', 0) + (1 - decay) * g2.mean(axis=-2)
        v = np.expand_dims(state['r'], -1) * np.expand_dims(state['c'], -2)
        v = v / np.expand_dims(state['r'].mean(axis=-1, keepdims=True), -1)
    else:
        state['v'] = v = decay * state.get('v', 0) + (1 - decay) * g2
    u = g / np.sqrt(v)
    u = u / max(1.0, np.sqrt(np.mean(u ** 2)))
    return w - lr * u


def reference(tokens, *, lr, steps):
    graph = tf.Graph()
    with graph.as_default():
        X = v1.placeholder(tf.int32, [None, None])
        logits = gpt2_graph(HParams.from_json(TINY / 'hparams.json'), X)['logits']
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=X[:, 1:], logits=logits[:, :-1]))
        variables = v1.global_variables()
        grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, variables)]  # wte's, wpe's: dense
        session = v1.Session(graph=graph)
        v1.train.Saver(var_list=variables).restore(session, str(TINY / 'model.ckpt'))
    states, losses = {v.op.name: {} for v in variables}, []
    with graph.as_default():
        for t in range(1, steps + 1):
            out = session.run([loss, variables, grads], {X: tokens})
            losses.append(out[0])
            for variable, w, g in zip(variables, out[1], out[2]):
                variable.load(adafactor(w, g, states[variable.op.name], t, lr).astype(np.float32), session)
    return losses, {v.op.name: value for v, value in zip(variables, session.run(variables))}


def test_adafactor_steps_equal_the_reference():
    tokens = np.random.default_rng(0).integers(0, 512, (4, 12)).astype(np.int32)
    model = load_model(TINY)
    trainer = Trainer(model, 1e-3, 'adafactor', 2, True)  # accumulated and recomputed: the same mean gradient
    names = set(trainer.slots)
    assert 'model/h0/mlp/c_fc/w/Adafactor_vr' in names and 'model/h0/mlp/c_fc/w/Adam' not in names
    assert trainer.slots['model/h0/mlp/c_fc/w/Adafactor_vc'].shape == [1, 128]  # a column mean, not a moment
    # The attention as TensorFlow's ops, in the reference's order: the keys' bias steps by the sign of rounding
    # noise (below), and the RMS clip over the whole bias spreads that noise's size to its other entries (0.7% of
    # lr with the kernel's noise). The kernel's steps are compared with TF1's in test_train.
    with kernels.tensorflow_ops():
        losses = [trainer.step(tokens) for _ in range(3)]
    ref_losses, ref = reference(tokens, lr=1e-3, steps=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # float32 sums in another order
    start = load_model(TINY).variables_by_name()
    for name, variable in model.variables_by_name().items():
        # The update is lr-sized per value after the RMS clip, so where g is near 0 reassociation moves
        # g / sqrt(v) a little: 3e-3 of lr; a wrong decay, mean or clip moves 1e-1 of lr and more.
        ours, theirs, moved = variable.numpy(), ref[name], variable.numpy() - start[name].numpy()
        if name.endswith('c_attn/b'):  # the keys' bias: its gradient is 0 exactly (softmax ignores a shift of
            keys = slice(32, 64)       # every score of a row), so both sides step by the sign of rounding noise
            ours, theirs, moved = np.delete(ours, keys), np.delete(theirs, keys), np.delete(moved, keys)
        np.testing.assert_allclose(ours, theirs, atol=3e-6, err_msg=name)
        assert np.abs(moved).max() > 1e-4, name
