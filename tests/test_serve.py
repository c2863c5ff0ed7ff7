"""The completions server, started on 127.0.0.1 in a subprocess and spoken to through the official openai client."""

import concurrent.futures
import http.client
import json
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import gpt2_tf
from gpt2_tf.assets import bundled_checkpoint
from gpt2_tf.validate import GPT2Error

from conftest import require
from support import running

openai = require('openai')
require('fastapi')
require('uvicorn')
from gpt2_tf.serve import STREAM_CHUNK  # noqa: E402

KEY = 'test-key'
MODEL = 'test-checkpoint'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp('serve') / 'server.log'
    with open(log, 'w') as out:
        process = subprocess.Popen([sys.executable, '-m', 'gpt2_tf.cli', 'serve', '--model_dir', bundled_checkpoint(),
                                    '--port', str(port), '--api-key', KEY, '--max-batch', '8', '--queue-size', '24'],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(('127.0.0.1', port), timeout=1):
                break
        except OSError:
            assert process.poll() is None, log.read_text()
            time.sleep(0.3)
    yield url, process, log
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server[0] + '/v1', api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


def test_greedy_completion_equals_the_librarys_greedy_text(client, model):
    done = client.completions.create(model=MODEL, prompt='Hello there', max_tokens=12, temperature=0)
    ids = gpt2_tf.encode('Hello there')
    tokens = gpt2_tf.sample_sequence(model, 12, context=ids, temperature=0)[0, len(ids):]
    expected = gpt2_tf.decode(tokens[:list(tokens).index(50256)] if 50256 in tokens else tokens)
    assert done.choices[0].text == expected
    assert done.choices[0].finish_reason in ('length', 'stop')
    assert done.usage.prompt_tokens == len(ids) and done.model == MODEL


def test_streaming_gives_the_same_text_in_chunks_of_the_compiled_calls(client):
    # As long a stream as the window allows (2 + 120 - 1 <= 128). The server hands out each compiled call's
    # tokens (STREAM_CHUNK of them) as they come, so the text arrives in one chunk a call, not in one piece at
    # the end; how early the first one comes is bench/bench_serve.py's to measure.
    whole = client.completions.create(model=MODEL, prompt='Once upon', max_tokens=120, temperature=0)
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt='Once upon', max_tokens=120, temperature=0,
                                           stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert ''.join(pieces) == whole.choices[0].text and finish is not None
    calls = -(-whole.usage.completion_tokens // STREAM_CHUNK)
    assert calls > 1 and len(pieces) >= calls, (len(pieces), whole.usage.completion_tokens)


def test_n_choices_are_ordered_prompt_major_and_seeded(client):
    done = client.completions.create(model=MODEL, prompt=['A', 'B'], max_tokens=6, n=3, seed=5)
    assert [c.index for c in done.choices] == [0, 1, 2, 3, 4, 5]
    again = client.completions.create(model=MODEL, prompt=['A', 'B'], max_tokens=6, n=3, seed=5)
    assert [c.text for c in done.choices] == [c.text for c in again.choices]
    assert len({c.text for c in done.choices[:3]}) > 1  # the three choices of one prompt differ


def test_a_seeded_request_is_the_same_alone_and_among_concurrent_ones(client):
    alone = client.completions.create(model=MODEL, prompt='The sea', max_tokens=16, seed=42).choices[0].text

    def request(i):
        if i == 3:
            return client.completions.create(model=MODEL, prompt='The sea', max_tokens=16, seed=42).choices[0].text
        return client.completions.create(model=MODEL, prompt=f'Noise {i} ' * (i + 1), max_tokens=8 + i,
                                         temperature=0.7, seed=i, extra_body={'top_k': 10 + i}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(request, range(8)))
    assert texts[3] == alone


def test_top_k_goes_through_extra_body(client, model):
    done = client.completions.create(model=MODEL, prompt='Hi', max_tokens=5, seed=3, extra_body={'top_k': 1})
    greedy = client.completions.create(model=MODEL, prompt='Hi', max_tokens=5, temperature=0)
    assert done.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy


def test_echo_logprobs_with_no_new_tokens_equals_score(client, model):
    text = 'The quick brown fox jumps over the lazy dog'
    done = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=3)
    choice = done.choices[0]
    assert choice.text == text
    ids = gpt2_tf.encode(text)
    expected = gpt2_tf.score(model, [ids])[0]
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose(got[1:], expected, atol=1e-4)
    assert ''.join(choice.logprobs.tokens) == text
    # the 3 likeliest, and the prompt's own token always (OpenAI's "up to logprobs + 1")
    for piece, top in zip(choice.logprobs.tokens[1:], choice.logprobs.top_logprobs[1:]):
        assert piece in top and len(top) == 3 + (piece not in sorted(top, key=top.get)[-3:])


def test_echoes_of_several_prompts_of_different_lengths_each_equal_score(client, model):
    texts = ['The quick brown fox jumps over the lazy dog', 'Hi there', 'A', 'Once upon a time, in a land far away']
    done = client.completions.create(model=MODEL, prompt=texts, max_tokens=0, echo=True, logprobs=1)
    for text, choice in zip(texts, sorted(done.choices, key=lambda c: c.index)):
        ids = gpt2_tf.encode(text)
        assert choice.text == text and len(choice.logprobs.token_logprobs) == len(ids)
        if len(ids) > 1:
            np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], gpt2_tf.score(model, [ids])[0], atol=1e-4)


def test_generated_logprobs_come_from_the_models_distribution(client, model):
    done = client.completions.create(model=MODEL, prompt='Hello', max_tokens=6, logprobs=2, seed=9, temperature=0.8)
    lp = done.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens)
    for piece, drawn, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[piece] == drawn and len(top) in (2, 3)  # the 2 likeliest, and the drawn token's always
    full = gpt2_tf.encode('Hello' + ''.join(lp.tokens))
    scored = gpt2_tf.score(model, [full])[0][-len(lp.tokens):]
    np.testing.assert_allclose(lp.token_logprobs, scored, atol=1e-3)


def test_stop_strings_end_a_choice(client):
    whole = client.completions.create(model=MODEL, prompt='One', max_tokens=30, temperature=0).choices[0].text
    if len(whole) < 6:
        pytest.skip('the greedy text is too short to cut')
    stop = whole[3:6]
    done = client.completions.create(model=MODEL, prompt='One', max_tokens=30, temperature=0, stop=[stop])
    assert done.choices[0].text == whole[:whole.find(stop)] and done.choices[0].finish_reason == 'stop'


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model='test', prompt='Hi', max_tokens=2)  # the bundled checkpoint's name
    assert done.model == 'test'
    import urllib.request

    with urllib.request.urlopen(server[0] + '/health', timeout=10) as response:
        assert response.status == 200


@pytest.mark.parametrize('kwargs, error, message', [
    (dict(model='gpt-4'), 'NotFoundError', "model 'gpt-4' is not served here"),
    (dict(max_tokens=200), 'BadRequestError', 'exceeds the window'),
    (dict(temperature=3), 'BadRequestError', 'temperature'),
    (dict(best_of=2, n=3), 'BadRequestError', r'best_of must be an integer in \[n, 16\]'),
    (dict(logit_bias={'60000': -100}), 'BadRequestError', "logit_bias: '60000' is not a token id"),
    (dict(presence_penalty=2.5), 'BadRequestError', r'presence_penalty: must be in \[-2, 2\]'),
    (dict(suffix='x'), 'BadRequestError', 'suffix: not supported by this server: leave it out'),
    (dict(prompt=[[1, 60000]]), 'BadRequestError', 'token id 60000 is outside the vocabulary'),
    (dict(logprobs=9), 'BadRequestError', 'logprobs'),
])
def test_errors_arrive_as_the_clients_own_exceptions(client, kwargs, error, message):
    options = {**dict(model=MODEL, prompt='Hi', max_tokens=4), **kwargs}
    with pytest.raises(getattr(openai, error), match=message) as raised:
        client.completions.create(**options)
    assert raised.value.status_code in (400, 404)


def test_a_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server[0] + '/v1', api_key='nope', max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt='Hi', max_tokens=2)


def test_a_body_over_the_limit_is_413_in_the_openai_shape(server):
    # The body declares 2 MiB but only a few bytes are sent: the server answers from the headers, and the
    # client reads the answer without ever writing into a closed connection (no broken pipe to race with).
    host, port = server[0].removeprefix('http://').split(':')
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest('POST', '/v1/completions')
    for name, value in (('Authorization', f'Bearer {KEY}'), ('Content-Type', 'application/json'),
                        ('Content-Length', str(2 << 20))):
        connection.putheader(name, value)
    connection.endheaders(b'{"prompt": "xx')
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    assert response.status == 413
    assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}
    assert body['error']['type'] == 'invalid_request_error'
    assert '2,097,152 bytes' in body['error']['message'] and '1,048,576' in body['error']['message']


def test_a_full_queue_is_503_with_retry_after_and_the_server_survives(client, server):
    slow = dict(model=MODEL, prompt='Busy', max_tokens=100, n=8)  # 8 rows each; the queue holds 24

    def request(_):
        try:
            client.completions.create(**slow)
            return 200
        except openai.APIStatusError as e:
            return (e.status_code, e.response.headers.get('retry-after'))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(request, range(8)))
    assert (503, '1') in results and 200 in results
    assert client.completions.create(model=MODEL, prompt='Hi', max_tokens=2).choices  # still serving


def test_a_client_that_disconnects_mid_stream_frees_its_place(client, server):
    stream = client.completions.create(model=MODEL, prompt='Long', max_tokens=120, stream=True)
    next(iter(stream))
    stream.close()  # hang up after the first chunk
    done = client.completions.create(model=MODEL, prompt='Hi', max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason in ('length', 'stop')
    assert server[1].poll() is None


def test_the_command_line_server_logs_one_line_per_request(client, server):
    client.completions.create(model=MODEL, prompt='Logged', max_tokens=3, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model='gpt-4', prompt='Hi', max_tokens=2)
    deadline = time.monotonic() + 30  # each line is written once its response has gone
    while True:
        lines = [line for line in server[2].read_text().splitlines() if line.startswith('gpt2-tf: POST /v1/compl')]
        if (lines and ' 404 ' in lines[-1]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert re.fullmatch(r'gpt2-tf: POST /v1/completions 200 prompt_tokens=2 completion_tokens=[0-3] latency_ms=\d+',
                        lines[-2]), lines[-2:]
    assert re.fullmatch(r'gpt2-tf: POST /v1/completions 404 latency_ms=\d+', lines[-1]), lines[-1]


def refused(client, **kwargs):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, temperature=0, **kwargs)
    return raised.value


def test_the_window_is_exact_prompt_plus_max_tokens_minus_one_is_n_ctx(client):
    n_ctx = 128  # the bundled checkpoint's hparams.json
    done = client.completions.create(model=MODEL, prompt=[1] * 120, max_tokens=9, temperature=0)  # 120 + 9 - 1
    assert done.usage.prompt_tokens == 120 and done.usage.completion_tokens <= 9
    assert done.choices[0].finish_reason in ('length', 'stop')
    for prompt, max_tokens in ((121, 9), (120, 10)):  # one over, either way
        error = refused(client, prompt=[1] * prompt, max_tokens=max_tokens)
        assert error.status_code == 400
        assert error.response.json() == {'error': {
            'message': f'prompt 0: {prompt} tokens + max_tokens {max_tokens} exceeds the window by 1 '
                       f'(needs prompt + max_tokens - 1 <= n_ctx = {n_ctx}): shorten the prompt or ask for fewer '
                       f'new tokens',
            'type': 'invalid_request_error', 'param': 'max_tokens', 'code': None}}


def test_options_are_refused_with_their_name(client):
    for options, param in ((dict(top_p=1.5), 'top_p'), (dict(extra_body={'top_k': -1}), 'top_k'),
                           (dict(seed=2 ** 63), 'seed'), (dict(prompt=[[3, -1]]), 'prompt')):
        error = refused(client, **{'prompt': 'Hi', 'max_tokens': 2, **options})
        assert error.response.json()['error']['param'] == param, options


# --- in-process: the served names, and a taken port -----------------------------------------------

@pytest.fixture(scope='module')
def named_server(model):
    from gpt2_tf.encoder import encoder_for
    from gpt2_tf.serve import create_app

    app = create_app(model, encoder_for(bundled_checkpoint()), model_id='test', aliases=['test-checkpoint'],
                     mode='eager')
    with running(app) as port:
        yield openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=60)


def test_the_model_answers_to_its_id_and_its_aliases(named_server):
    assert [m.id for m in named_server.models.list().data] == ['test']
    for name in ('test', 'test-checkpoint'):
        done = named_server.completions.create(model=name, prompt='Hi', max_tokens=2, temperature=0)
        assert done.model == name and done.choices[0].finish_reason in ('length', 'stop')
    with pytest.raises(openai.NotFoundError, match="this server serves 'test', 'test-checkpoint'"):
        named_server.completions.create(model='124M', prompt='Hi', max_tokens=2)


def test_a_taken_port_is_one_error_before_anything_is_said(model, capfd):
    from gpt2_tf.serve import PortTaken, serve

    with socket.create_server(('127.0.0.1', 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(PortTaken, match=rf'^port {port} on 127\.0\.0\.1 is taken; try --port \d+$') as raised:
            serve(model, gpt2_tf.get_encoder(), model_id='test', port=port)
    assert isinstance(raised.value, GPT2Error)
    assert int(str(raised.value).rsplit(' ', 1)[1]) != port
    assert 'serving' not in capfd.readouterr().err


def test_the_command_line_reports_a_taken_port_in_one_line():
    with socket.create_server(('127.0.0.1', 0)) as held:
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'serve', '--model_dir', bundled_checkpoint(),
                               '--port', str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert 'Traceback' not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith('gpt2-tf: error:')]
    assert len(errors) == 1 and errors[0].startswith(f'gpt2-tf: error: port {port} on 127.0.0.1 is taken; try --port ')
