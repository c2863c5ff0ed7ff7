"""The completions fields beyond sampling's: logit_bias, presence_penalty, frequency_penalty and best_of.

Tested by what the server draws (a forced token always, a banned one never, the
library's own penalised greedy text, best_of's likeliest choices) and by what it
refuses, on the in-process server of test_serve_hostile over the bundled checkpoint.
"""

import json

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf.assets import bundled_checkpoint

from test_serve_hostile import make_app, openai, post, running

END = 50256


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


@pytest.fixture(scope='module')
def served(model):
    with running(make_app(model)) as port:
        yield port, openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=120)


def complete(served, **fields):
    return served[1].completions.create(model='test', **{'prompt': 'Hello there', 'max_tokens': 4, **fields})


# --- refused -----------------------------------------------------------------------------------------

@pytest.mark.parametrize('fields, param, message', [
    ({'logit_bias': {'x': 5}}, 'logit_bias', "'x' is not a token id"),
    ({'logit_bias': {'50257': 5}}, 'logit_bias', "'50257' is not a token id: use ids in [0, 50256]"),
    ({'logit_bias': {'-1': 5}}, 'logit_bias', "'-1' is not a token id"),
    ({'logit_bias': {'²': 5}}, 'logit_bias', "'²' is not a token id"),  # a digit to str.isdigit, not to int()
    ({'logit_bias': {'13': 101}}, 'logit_bias', 'the bias of token 13 is 101.0; use values in [-100, 100]'),
    ({'presence_penalty': 2.5}, 'presence_penalty', 'must be in [-2, 2], got 2.5'),
    ({'frequency_penalty': -2.01}, 'frequency_penalty', 'must be in [-2, 2], got -2.01'),
    ({'best_of': 2, 'n': 3}, 'best_of', 'best_of must be an integer in [n, 16] (n = 3), got 2'),
    ({'best_of': 17}, 'best_of', 'best_of must be an integer in [n, 16] (n = 1), got 17'),
    ({'best_of': 2, 'stream': True}, 'best_of', 'best_of cannot be streamed'),
    ({'n': True}, 'n', 'Input should be a valid integer'),  # JSON's true is not 1, nor "2" 2
    ({'max_tokens': '2'}, 'max_tokens', 'Input should be a valid integer'),
    ({'temperature': True}, 'temperature', 'Input should be a valid number'),
    ({'stream': 'yes'}, 'stream', 'Input should be a valid boolean'),
    ({'stream': True, 'stream_options': {'include_usage': 'no'}}, 'stream_options', 'Input should be a valid boolean'),
    ({'stream': True, 'stream_options': {'include_usge': True}}, 'stream_options',
     "unknown field 'stream_options.include_usge'"),
    ({'max_tokens': 0, 'echo': True, 'logprobs': 1, 'prompt': [1] * 200}, 'prompt',
     'prompt 0: 200 tokens, more than the 128 this model reads; an echoed prompt is scored in one call: shorten it'),
    ({'max_tokens': 0, 'prompt': [1] * 200}, 'prompt',  # nothing drawn or scored: still past the window
     'prompt 0: 200 tokens, more than the 128 this model reads; shorten it'),
])
def test_out_of_range_fields_are_400_naming_the_field(served, fields, param, message):
    status, body = post(served[0], json.dumps({'prompt': 'Hi', 'max_tokens': 2, **fields}).encode())
    assert status == 400
    assert body['error']['param'] == param and message in body['error']['message'], body


def test_the_defaults_that_clients_send_are_accepted(served):
    done = complete(served, best_of=1, logit_bias={}, presence_penalty=0, frequency_penalty=0, temperature=0)
    assert len(done.choices) == 1 and done.choices[0].finish_reason in ('length', 'stop')
    chunks = list(complete(served, stream=True, stream_options={'include_usage': None}))  # null: the default, off
    assert chunks and all(chunk.usage is None for chunk in chunks)


# --- what they draw ---------------------------------------------------------------------------------

def test_a_token_biased_by_100_is_always_drawn(served):
    done = complete(served, max_tokens=8, n=4, seed=3, temperature=1.0, logit_bias={'13': 100})
    assert [c.text for c in done.choices] == [gpt2_tf.decode([13]) * 8] * 4


def test_a_token_biased_by_minus_100_is_never_drawn(served, model):
    ids = gpt2_tf.encode('Hello there')
    likeliest = int(gpt2_tf.sample_sequence(model, 1, context=ids, temperature=0, mode='eager')[0, -1])
    banned = gpt2_tf.decode([likeliest])
    free = complete(served, max_tokens=1, n=16, seed=5, top_p=1.0, extra_body={'top_k': 2})
    assert banned in [c.text for c in free.choices]  # without the bias it is drawn: top-1 of 2, 16 draws
    done = complete(served, max_tokens=1, n=16, seed=5, extra_body={'top_k': 2}, logit_bias={str(likeliest): -100})
    assert banned not in [c.text for c in done.choices]


def test_top_p_keeps_the_originals_rule_not_the_token_that_crosses_p(served, model):
    ids = gpt2_tf.encode('Hello there')
    logits = np.asarray(model(np.array([ids]))['logits'][0, -1], np.float64)
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    first, second = np.argsort(-probs)[:2]
    p = probs[first] + probs[second] / 2  # past the first token's mass, short of the second's cumulative
    done = complete(served, max_tokens=1, n=16, seed=5, top_p=float(p))
    assert {c.text for c in done.choices} == {gpt2_tf.decode([int(first)])}  # vLLM's rule would draw the second


@pytest.mark.parametrize('options', [dict(presence_penalty=2.0), dict(frequency_penalty=1.5)])
def test_penalties_give_the_librarys_penalised_greedy_text(served, model, options):
    ids = gpt2_tf.encode('Hello there')
    done = complete(served, max_tokens=24, temperature=0, logit_bias={str(END): -100}, **options)
    tokens = gpt2_tf.sample_sequence(model, 24, context=ids, temperature=0, logit_bias={END: -100}, mode='eager',
                                     **options)
    plain = gpt2_tf.sample_sequence(model, 24, context=ids, temperature=0, logit_bias={END: -100}, mode='eager')
    assert done.choices[0].text == gpt2_tf.decode(tokens[0, len(ids):])
    assert gpt2_tf.decode(plain[0, len(ids):]) != done.choices[0].text  # the penalties change this text


def mean_logprobs(choices) -> list:
    return [float(np.mean(c.logprobs.token_logprobs)) for c in choices]


def test_best_of_returns_the_n_likeliest_of_its_draws_and_counts_them_all(served):
    fields = dict(prompt=['Hello there', 'One two'], max_tokens=6, seed=11, logit_bias={str(END): -100})
    # The same seed and rows (choice i * best_of + j draws with the key (seed, i * best_of + j)), all returned.
    every = complete(served, n=4, logprobs=1, **fields)
    best = complete(served, n=2, best_of=4, **fields)
    assert [c.index for c in best.choices] == [0, 1, 2, 3] and all(c.logprobs is None for c in best.choices)
    for prompt in range(2):
        drawn = every.choices[prompt * 4:(prompt + 1) * 4]
        means = mean_logprobs(drawn)
        likeliest = [drawn[i].text for i in sorted(range(4), key=lambda i: -means[i])[:2]]
        assert [c.text for c in best.choices[prompt * 2:(prompt + 1) * 2]] == likeliest
    assert best.usage.completion_tokens == 2 * 4 * 6  # every draw, kept or not (no end of text: banned)
    prompts = len(gpt2_tf.encode('Hello there')) + len(gpt2_tf.encode('One two'))
    assert best.usage.prompt_tokens == every.usage.prompt_tokens == prompts  # once per prompt, whatever n


@pytest.mark.parametrize('prompt, seed, stop', [('Hello there', seed, ['e', 'a']) for seed in range(4)]
                         + [('Hello', 0, [' '])])  # its first draw is cut to nothing
def test_best_of_ranks_by_the_tokens_through_the_stop(served, prompt, seed, stop):
    """The mean over the tokens drawn through the stop string, which the same draws uncut give: a choice that a
    stop cut to nothing is ranked by what it drew, not at 0 above every other."""
    fields = dict(prompt=prompt, max_tokens=10, seed=seed, logit_bias={str(END): -100})
    whole = complete(served, n=4, logprobs=0, **fields)  # the same draws, uncut: every token's log-prob
    best = complete(served, n=1, best_of=4, stop=stop, **fields)
    means, cuts = [], []
    for choice in whole.choices:
        found = [(choice.text.find(s) + len(s), choice.text.find(s)) for s in stop if s in choice.text]
        end, at = min(found, default=(len(choice.text), len(choice.text)))
        starts = np.array(choice.logprobs.text_offset) - choice.logprobs.text_offset[0]
        means.append(float(np.mean(np.array(choice.logprobs.token_logprobs)[starts < end])))
        cuts.append(choice.text[:at])
    assert best.choices[0].text == cuts[int(np.argmax(means))]
    if stop == [' ']:
        assert cuts[0] == '' and best.choices[0].text != ''


def test_best_of_with_logprobs_returns_the_chosen_ones_logprobs(served):
    fields = dict(max_tokens=5, seed=2, logit_bias={str(END): -100}, logprobs=2)
    every = complete(served, n=3, **fields)
    best = complete(served, n=1, best_of=3, **fields)
    means = mean_logprobs(every.choices)
    chosen = every.choices[int(np.argmax(means))]
    assert best.choices[0].text == chosen.text
    np.testing.assert_allclose(best.choices[0].logprobs.token_logprobs, chosen.logprobs.token_logprobs, atol=1e-6)


# --- OpenAI's nulls, large numbers, usage and streamed logprobs ---------------------------------------

def test_null_fields_take_their_defaults(served):
    nulls = dict(max_tokens=None, temperature=None, top_p=None, n=None, echo=None, stream=None,
                 presence_penalty=None, frequency_penalty=None, logprobs=None, stop=None, best_of=None, user=None)
    status, body = post(served[0], json.dumps({'prompt': 'Hello there', 'seed': 4, **nulls}).encode())
    assert status == 200, body
    plain = served[1].completions.create(model='test', prompt='Hello there', seed=4)
    assert body['choices'][0]['text'] == plain.choices[0].text
    assert body['usage'] == plain.usage.model_dump(exclude_none=True)


def test_a_top_k_past_any_integer_type_means_no_truncation(served):
    huge = complete(served, max_tokens=8, n=3, seed=6, extra_body={'top_k': 10 ** 23})
    plain = complete(served, max_tokens=8, n=3, seed=6, extra_body={'top_k': 0})
    assert [c.text for c in huge.choices] == [c.text for c in plain.choices]


def test_usage_counts_the_tokens_up_to_the_stop_string(served):
    whole = complete(served, max_tokens=24, temperature=0, logprobs=0, logit_bias={str(END): -100}).choices[0]
    offsets, text = whole.logprobs.text_offset, whole.text
    cut = next((k for k in range(2, 7) if text.find(text[offsets[k]:offsets[k] + 3]) == offsets[k]), None)
    if cut is None:
        pytest.skip('no token-aligned stop string in the greedy text')
    stop = text[offsets[cut]:offsets[cut] + 3]
    done = complete(served, max_tokens=24, temperature=0, logprobs=0, logit_bias={str(END): -100}, stop=[stop])
    assert done.choices[0].text == text[:offsets[cut]] and done.choices[0].finish_reason == 'stop'
    assert done.usage.completion_tokens == cut == len(done.choices[0].logprobs.tokens)  # not the chunk's 8


def test_a_streamed_chunk_carries_the_logprobs_of_its_own_tokens(served):
    fields = dict(max_tokens=24, temperature=0, logprobs=1, logit_bias={str(END): -100}, prompt='One two three')
    whole = complete(served, **fields).choices[0]
    sent, entries, carrying = '', {'tokens': [], 'token_logprobs': [], 'text_offset': []}, 0
    for chunk in served[1].completions.create(model='test', stream=True, **fields):
        choice = chunk.choices[0]
        for offset in choice.logprobs.text_offset:  # each token starts in this chunk's text
            assert len(sent) <= offset < len(sent) + len(choice.text), (sent, choice.text, offset)
        for name in entries:
            entries[name] += getattr(choice.logprobs, name)
        carrying += bool(choice.logprobs.tokens)
        sent += choice.text
    assert sent == whole.text and carrying >= 3  # 24 tokens come in 8-token chunks
    assert entries == {name: getattr(whole.logprobs, name) for name in entries}


def test_the_text_offsets_of_tokens_inside_a_character_stay_on_it():
    from gpt2_tf.encoder import get_encoder
    from gpt2_tf.serve.completion import Choice

    encoder = get_encoder()
    ids = encoder.encode('a\U0001d11eb')  # the clef's four UTF-8 bytes in three tokens
    assert len(ids) == 5
    choice = Choice(0, encoder, [], logprobs=0)
    choice.add(ids, {'log_probs': np.zeros(5), 'top_ids': np.zeros((5, 1), int), 'top_log_probs': np.zeros((5, 1))})
    assert choice.entries['text_offset'] == [0, 1, 1, 1, 2]  # 'b' at 2, as in 'a\U0001d11eb'; none past it


@pytest.mark.parametrize('stops, text', [(['world', 'Hello w'], ''), (['Hello w', 'world'], ''),
                                         (['o w', 'lo'], 'Hel'), (['lo', 'o w'], 'Hel'),
                                         (['cd', 'abcde'], 'ab'), (['abcde', 'cd'], 'ab'),  # 'cd' ends first
                                         (['bc', 'abc'], ''), (['abc', 'bc'], ''),  # ending together: the longer
                                         (['xyz', 'c'], 'ab')])
@pytest.mark.parametrize('at_once', [True, False])
def test_the_stop_string_that_ends_first_cuts_the_text_whatever_their_order(stops, text, at_once):
    from gpt2_tf.encoder import get_encoder
    from gpt2_tf.serve.completion import Choice

    encoder = get_encoder()
    whole = 'Hello world, foo bar' if 'H' in ''.join(stops) or 'w' in ''.join(stops) else 'abcdef and more'
    ids = encoder.encode(whole)
    choice = Choice(0, encoder, stops, logprobs=None)
    sent = ''.join(choice.add(ids, None) for _ in [0]) if at_once else ''.join(choice.add([t], None) for t in ids)
    sent += choice.finish()
    assert (sent, choice.finish_reason) == (text, 'stop')


def test_tokens_inside_a_character_are_written_as_their_bytes_each_its_own_key():
    from gpt2_tf.encoder import get_encoder
    from gpt2_tf.serve.completion import Choice

    encoder = get_encoder()
    ids = encoder.encode('a\U0001d11eb')  # the clef's four UTF-8 bytes in three tokens
    parts = [encoder.token_bytes(t) for t in ids[1:4]]
    choice = Choice(0, encoder, [], logprobs=2)
    choice.add(ids, {'log_probs': -np.arange(1.0, 6.0), 'top_ids': np.array([[ids[2], ids[3]]] * 5),
                     'top_log_probs': np.array([[-0.1, -0.2]] * 5)})
    pieces = choice.entries['tokens']
    assert pieces[1:4] == ['bytes:' + ''.join(f'\\x{b:02x}' for b in part) for part in parts]  # as OpenAI's
    assert b''.join(parts) == '\U0001d11e'.encode('utf-8') and len(set(pieces)) == 5
    top = choice.entries['top_logprobs'][1]  # the drawn token and the two others, each under its own key
    assert top == {pieces[1]: -2.0, pieces[2]: -0.1, pieces[3]: -0.2}


def test_an_echoed_prompts_offsets_count_as_its_generated_tokens_do(model):
    from gpt2_tf.encoder import get_encoder
    from gpt2_tf.serve.completion import echo_logprobs

    encoder = get_encoder()
    ids = encoder.encode('a\U0001d11eb')
    entries = echo_logprobs(model, encoder, ids, 1)
    assert entries['text_offset'] == [0, 1, 1, 1, 2]
    rng = np.random.default_rng(0)
    alphabet = list('ab .é€日本\U0001f600\U0001d11e')  # one to four UTF-8 bytes: BPE splits some characters
    for _ in range(20):
        ids = encoder.encode(''.join(rng.choice(alphabet, 10)))[:40]
        entries = echo_logprobs(model, encoder, ids, 1)
        starts = np.cumsum([0] + [len(encoder.token_bytes(t)) for t in ids])[:-1]  # each token's first byte
        whole = b''.join(encoder.token_bytes(t) for t in ids)  # valid UTF-8: the characters wholly before it
        assert entries['text_offset'] == [len(whole[:at].decode('utf-8', 'ignore')) for at in starts]


def test_an_empty_prompt_echoes_as_nothing(served):
    done = complete(served, prompt=['', 'A'], max_tokens=0, echo=True)
    assert [c.text for c in done.choices] == ['', 'A']
    assert done.usage.prompt_tokens == 1  # the prompts as sent: 'A'
    drawn = complete(served, prompt=[[]], max_tokens=2, echo=True, temperature=0)
    assert not drawn.choices[0].text.startswith('<|endoftext|>')


def test_an_unexpected_failure_is_a_500_in_the_openai_shape(served, monkeypatch):
    from gpt2_tf.serve import protocol

    def broken(*args, **kwargs):
        raise RuntimeError('a bug')

    monkeypatch.setattr(protocol.CompletionRequest, 'biases', broken)
    status, body = post(served[0], json.dumps({'prompt': 'Hi', 'max_tokens': 2}).encode())
    assert status == 500 and set(body) == {'error'} and body['error']['type'] == 'server_error', body
    assert 'RuntimeError' in body['error']['message']


def test_echoes_are_scored_in_groups_of_a_power_of_two_rows_within_the_token_bound(model, monkeypatch):
    from gpt2_tf.compiled import bucket
    from gpt2_tf.encoder import get_encoder
    from gpt2_tf.serve import completion

    lengths = [5, 60, 3, 3, 100, 7, 1, 20]
    groups = completion.echo_groups([[1] * n for n in lengths], 256)
    assert [i for group in groups for i in group] == list(range(len(lengths)))  # every prompt, in order
    for group in groups:
        rows = 1 << (len(group) - 1).bit_length()
        assert len(group) == 1 or rows * bucket(max(lengths[i] for i in group)) <= 256
    seen, score = [], completion.score
    monkeypatch.setattr(completion, 'score',
                        lambda model, rows, **kw: seen.append(len(rows)) or score(model, rows, **kw))
    prompts = [[464, 2068, 7586], [464, 2068], [5]]  # the last has nothing to score
    entries = completion.echo_entries(model, get_encoder(), prompts, 1)
    assert seen == [2]  # two scorable rows: a power of two already
    completion.echo_entries(model, get_encoder(), prompts + [[1, 2, 3]], 1)
    assert seen == [2, 4]  # three scorable rows padded to four
    for prompt, got in zip(prompts, entries):
        alone = completion.echo_logprobs(model, get_encoder(), prompt, 1)
        np.testing.assert_allclose([x for x in got['token_logprobs'] if x is not None],
                                   [x for x in alone['token_logprobs'] if x is not None], atol=1e-5)
