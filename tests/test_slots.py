"""In-flight batching (gpt2_tf.slots): rows that join and leave a running batch draw what they draw alone."""

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.sample import sample_sequence
from gpt2_tf.slots import Slots, cache_size
from gpt2_tf.validate import GPT2Error

from support import compiled_hlo


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


def rows(seed=0):
    """(prompt, length, key, options) of rows of different prompt lengths, lengths and options."""
    rng = np.random.default_rng(seed)
    table = [(5, 20, dict(temperature=0.0)), (13, 7, dict(temperature=1.0)), (3, 30, dict(temperature=0.9, top_k=40)),
             (40, 12, dict(temperature=1.0, top_p=0.9)), (9, 25, dict(temperature=0.7)), (2, 3, dict(top_k=1)),
             (20, 9, dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={11: 5.0})),
             (6, 14, dict(temperature=0.0, repetition_penalty=1.3))]
    return [([int(t) for t in rng.integers(0, 50257, n)], length, (i, 77), options)
            for i, (n, length, options) in enumerate(table)]


def alone(model, prompt, length, key, options, mode):
    out = sample_sequence(model, length, context=[prompt], seed=np.array([key]), mode=mode, **options)
    return out[0][len(prompt):].tolist()


def in_flight(model, table, *, slots, chunk, mode):
    """Runs every row through `slots` slots: a finished row leaves and the next one joins at its chunk's end."""
    engine = Slots(model, slots, chunk=chunk, mode=mode)
    got, held, waiting, sizes = {i: [] for i in range(len(table))}, {}, list(range(len(table))), set()
    while waiting or held:
        for slot in engine.free():
            if waiting:
                i = waiting.pop(0)
                prompt, length, key, options = table[i]
                engine.join(slot, prompt, length=length, key=key, **options)
                held[slot] = i
        out = engine.step()
        sizes.add(engine.caches[0].shape[3])
        for slot, i in list(held.items()):
            length = table[i][1]
            got[i] += out['tokens'][slot, :length - len(got[i])].tolist()
            if len(got[i]) == length:
                engine.leave(slot)
                del held[slot]
    return got, sizes


@pytest.mark.parametrize('mode, slots, chunk, which', [('function', 3, 4, None), ('function', 2, 8, None),
                                                       ('xla', 2, 8, [0, 3, 2, 6])])  # XLA compiles for seconds
def test_rows_joining_and_leaving_draw_their_solo_tokens(model, mode, slots, chunk, which):
    table = rows()
    table = [table[i] for i in which] if which else table
    got, sizes = in_flight(model, table, slots=slots, chunk=chunk, mode=mode)
    for i, (prompt, length, key, options) in enumerate(table):
        assert got[i] == alone(model, prompt, length, key, options, mode), (i, options)
    assert len(sizes) > 1  # the cache grew for the long prompt and shrank after it


@pytest.mark.parametrize('mode, start, length', [('eager', 8, 121), ('function', 8, 121),  # XLA's gather clamps
                                                 ('function', 65, 63)])  # an index past wpe; these raise
def test_a_row_that_fills_the_window_decodes_past_it_in_its_last_chunk(model, mode, start, length):
    """8 prompt tokens + 121 new - 1 = n_ctx: the last chunk also feeds tokens past the window (and an idle
    slot beside it runs on), whose outputs nobody reads; the step must not fail on their positions. 65 prompt
    tokens are padded to 128 slots: with 63 new ones the row needs 191."""
    engine = Slots(model, 2, chunk=8, mode=mode)
    prompt = list(range(1, start + 1))
    engine.join(0, prompt, length=length, key=(3, 4))
    engine.join(1, [5], length=2, key=(0, 1))
    got, sizes = [], set()
    while len(got) < length:
        got += engine.step()['tokens'][0, :length - len(got)].tolist()
        sizes.add(engine.caches[0].shape[3])
        if engine.occupied[1]:
            engine.leave(1)
    assert got == alone(model, prompt, length, (3, 4), {}, mode)
    assert sizes == {128 + 64}  # the window and a bucket's padding, not the next power of two (256)


def test_the_cache_sizes_are_powers_of_two_up_to_the_window_and_its_padding():
    assert [cache_size(n, 1024) for n in (1, 64, 65, 128, 129, 1000, 1025, 1087)] == \
        [64, 64, 128, 128, 256, 1024, 1088, 1088]
    assert [cache_size(n, 128) for n in (100, 129, 191)] == [128, 192, 192]


def test_only_the_slots_up_to_the_highest_held_one_decode(model):
    engine = Slots(model, 8, chunk=2, mode='function')
    engine.join(0, [1, 2], length=30, key=(0, 0))
    assert engine.step()['tokens'].shape == (1, 2)  # one row: a batch of one, not of eight
    engine.join(2, [3], length=4, key=(0, 1))
    assert engine.step()['tokens'].shape == (4, 2)  # slots 0 .. 3, in powers of two
    engine.leave(2)
    alone = engine.step()['tokens']
    assert alone.shape == (1, 2)
    expected = sample_sequence(model, 6, context=[[1, 2]], seed=np.array([(0, 0)]), mode='function')[0, 2:]
    assert engine.made[0] == 6 and alone[0].tolist() == expected[4:].tolist()


def test_bad_rows_are_refused_before_anything_runs(model):
    engine = Slots(model, 2, chunk=4, mode='function')
    with pytest.raises(GPT2Error, match='exceeds the window'):
        engine.join(0, [1] * 100, length=40, key=(0, 0))
    with pytest.raises(GPT2Error, match='logit_bias'):
        engine.join(0, [1, 2], length=4, key=(0, 0), logit_bias={60000: 1.0})
    for options, message in [(dict(temperature=-1.0), r'temperature must be in \[0, 2\]'),
                             (dict(temperature=float('nan')), 'temperature must be in'),
                             (dict(top_k=-3), 'top_k must be an integer >= 0'),
                             (dict(top_p=1.7), r'top_p must be in \[0, 1\]'),
                             (dict(key=(2 ** 70, 0)), 'seed values must be integers'),
                             (dict(key=5), r'key must be a pair of integers .*got shape \[\]')]:
        with pytest.raises(GPT2Error, match=message):
            engine.join(1, [1, 2], length=4, **{'key': (0, 0), **options})
    for slot, prompt, length, message in [
            (0, [], 4, r'the prompt must be one row of at least one token id, got shape \[0\]'),
            (0, [[1, 2]], 4, r'one row of at least one token id, got shape \[1, 2\]'),
            (0, 'Hello', 4, 'got text: encode it first'),
            (0, [1, 60000], 4, r"the prompt's token id 60000 is outside the vocabulary \[0, 50257\)"),
            (0, [-1], 4, "the prompt's token id -1 is outside"),
            (0, [1, 2], 0, 'length must be a positive integer, got 0'),
            (0, [1, 2], -5, 'length must be a positive integer, got -5'),
            (2, [1, 2], 4, r'slot must be an integer in \[0, 2\), got 2'),
            (-1, [1, 2], 4, r'slot must be an integer in \[0, 2\), got -1')]:
        with pytest.raises(GPT2Error, match=message):
            engine.join(slot, prompt, length=length, key=(0, 0))
    with pytest.raises(GPT2Error, match='no slot holds a row'):  # every join above left its slot free
        engine.step()
    assert not engine.occupied.any() and engine.top_k.tolist() == [0, 0]
    engine.join(0, [1, 2], length=4, key=(0, 0))
    with pytest.raises(GPT2Error, match=r'slot 0 is taken: join one of free\(\), or leave\(0\) first'):
        engine.join(0, [3], length=4, key=(0, 0))


def test_a_join_that_fails_once_its_prefill_ran_leaves_the_slot_free(model, monkeypatch):
    from gpt2_tf import slots as module
    from gpt2_tf.noise import row_keys

    engine = Slots(model, 2, chunk=4, mode='function')
    engine.join(0, [1, 2], length=4, key=row_keys(5, 1))  # row_keys' own [1, 2] shape is a key
    monkeypatch.setattr(module.tf, 'tensor_scatter_nd_update', lambda *a: (_ for _ in ()).throw(MemoryError('full')))
    with pytest.raises(MemoryError):
        engine.join(1, [3, 4, 5], length=4, key=(0, 0), top_k=5)
    monkeypatch.undo()
    assert engine.occupied.tolist() == [True, False] and engine.top_k.tolist() == [0, 0]
    assert engine.step()['tokens'].shape[0] == 1  # the one row decodes; the failed one left no trace


def test_a_step_compiles_once_wherever_its_rows_are(model):
    """Positions and step counts are arguments XLA must not need as constants, or every chunk compiles."""
    import tensorflow as tf

    engine = Slots(model, 2, chunk=4, mode='xla')
    engine.join(0, [1, 2, 3], length=20, key=(0, 1))
    hlo = []
    for pos, made in ((8, 0), (12, 4), (30, 9)):
        options, plan = engine.options(), engine.plan(None)
        hlo.append(compiled_hlo(engine._decode, model, engine.logits, engine.caches, options=options, plan=plan,
                                decoder=engine.decoder, state=(), pads=tf.constant(engine.pads[:1]),
                                pos=tf.constant([pos]), made=tf.constant([made])))
    assert hlo[0] == hlo[1] == hlo[2]
