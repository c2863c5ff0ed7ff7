"""The completions server against hostile and careless clients, and what it counts and logs.

An in-process server (uvicorn on 127.0.0.1 in a thread) over the bundled checkpoint,
spoken to through raw HTTP and the official openai client.
"""

import http.client
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

import gpt2_tf
from gpt2_tf import HParams
from gpt2_tf.assets import bundled_checkpoint

from conftest import require
from support import running

openai = require('openai')
require('fastapi')
require('uvicorn')
prometheus = require('prometheus_client')
from gpt2_tf.serve import STREAM_CHUNK  # noqa: E402

QUEUE = 24  # the test server's queue, in rows


def make_app(model, **options):
    from gpt2_tf.encoder import encoder_for
    from gpt2_tf.serve import create_app

    return create_app(model, encoder_for(bundled_checkpoint()), model_id='test', mode='eager', capacity=4,
                      queue_size=QUEUE, **options)


@pytest.fixture(scope='module')
def model():
    return gpt2_tf.load_model(bundled_checkpoint())


@pytest.fixture(scope='module')
def served(model):
    log = io.StringIO()
    app = make_app(model, access_log=log)
    with running(app) as port:
        yield types.SimpleNamespace(port=port, app=app, log=log)


def post(port, body: bytes, path='/v1/completions', method='POST', headers=()):
    """(status, parsed JSON body) of one raw request."""
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    connection.request(method, path, body=body, headers={'Content-Type': 'application/json', **dict(headers)})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


def test_a_vocabulary_without_end_of_text_serves_text_and_refuses_an_empty_prompt(random_checkpoint):
    from gpt2_tf.encoder import Encoder, bytes_to_unicode
    from gpt2_tf.serve import create_app

    encoder = Encoder({c: i for i, c in enumerate(bytes_to_unicode().values())}, [], fast=False)  # bytes alone
    model = gpt2_tf.load_model(random_checkpoint(HParams(n_vocab=256, n_ctx=16, n_embd=16, n_head=2, n_layer=1)))
    app = create_app(model, encoder, model_id='bytes', mode='eager', capacity=2, queue_size=4)
    with running(app) as port:
        status, body = post(port, json.dumps({'prompt': 'Hi', 'max_tokens': 3, 'seed': 1}).encode())
        assert status == 200 and body['usage']['completion_tokens'] == 3, body
        status, body = post(port, json.dumps({'prompt': ['Hi', ''], 'max_tokens': 3}).encode())
        assert status == 400 and body['error']['param'] == 'prompt', body
        assert "starts after <|endoftext|>, which this model's vocabulary does not have" in body['error']['message']


def assert_openai_error(body, message=None):
    """OpenAI's error shape, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}, body
    assert body['error']['type'] == 'invalid_request_error'
    if message is not None:
        assert re.search(message, body['error']['message']), body['error']['message']


# --- malformed bodies -------------------------------------------------------------------------------

def test_invalid_json_names_the_problem_and_no_param(served):
    status, body = post(served.port, b'{"prompt": "Hi", max_tokens: 4}')
    assert status == 400
    assert_openai_error(body, r'^the body is not valid JSON \(Expecting property name enclosed in double quotes '
                              r'at character 17\)')
    assert body['error']['param'] is None and 'JSON decode error' not in body['error']['message']


@pytest.mark.parametrize('raw', [b'', b'[1, 2]', b'"prompt"', b'null'])
def test_a_body_that_is_not_an_object_is_400_saying_so(served, raw):
    status, body = post(served.port, raw)
    assert status == 400
    assert_openai_error(body, '^the body must be a JSON object')
    assert body['error']['param'] is None


@pytest.mark.parametrize('content_type', ['text/plain', 'application/x-www-form-urlencoded'])  # curl -d's
def test_a_json_body_sent_as_another_type_is_told_to_send_json(served, content_type):
    status, body = post(served.port, b'{"prompt": "Hi", "max_tokens": 2}', headers={'Content-Type': content_type})
    assert status == 400
    assert_openai_error(body, f'^the body was sent as {content_type}: send JSON, with the header '
                              f'Content-Type: application/json$')


@pytest.mark.parametrize('raw, message', [
    (b'{"prompt": "\xff", "max_tokens": 1}', r'^the body is not UTF-8 \(byte 0xff at byte 12\): send JSON in UTF-8$'),
    (b'{"prompt": "Hi", "top_k": 1' + b'0' * 5000 + b'}', r'^the body holds a number of more than 4300 digits: '),
])
def test_a_body_json_cannot_read_is_named(served, raw, message):
    status, body = post(served.port, raw)
    assert status == 400
    assert_openai_error(body, message)
    assert body['error']['param'] is None


@pytest.mark.parametrize('key', ['', ' '])
def test_an_empty_api_key_is_refused_before_serving(model, key):
    """Every client would get a 401 (an unset $KEY in --api-key "$KEY")."""
    with pytest.raises(gpt2_tf.GPT2Error, match='^api_key is empty: give a key'):
        make_app(model, api_key=key)


def test_a_5000_deep_array_is_400_in_the_openai_shape(served):
    status, body = post(served.port, b'[' * 5000 + b']' * 5000)
    assert status == 400
    assert_openai_error(body, 'nests too deeply')


@pytest.mark.parametrize('method, path, status, message', [
    ('POST', '/v1/chat/completions', 404, r'^no route POST /v1/chat/completions: this server answers POST '
                                          r'/v1/completions'),
    ('GET', '/nothing/here', 404, '^no route GET /nothing/here'),
    ('GET', '/v1/completions', 405, '^GET is not allowed on /v1/completions'),
])
def test_unknown_routes_and_methods_answer_in_the_openai_shape(served, method, path, status, message):
    got, body = post(served.port, b'{}', path=path, method=method)
    assert got == status
    assert_openai_error(body, message)


# --- the body bound, with and without a Content-Length ------------------------------------------------

def chunked_request(port, chunks):
    """Sends a POST with Transfer-Encoding: chunked (no Content-Length), chunk by chunk; (status, body).

    With end=False in the last place of chunks, the terminating chunk is not sent: the server must answer
    from what it has counted so far.
    """
    *pieces, end = chunks
    with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
        sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n'
                     b'Transfer-Encoding: chunked\r\n\r\n')
        for piece in pieces:
            sock.sendall(b'%x\r\n%s\r\n' % (len(piece), piece))
        if end:
            sock.sendall(b'0\r\n\r\n')
        reply = b''
        while b'\r\n\r\n' not in reply or len(reply.split(b'\r\n\r\n', 1)[1]) < content_length(reply):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, body = reply.split(b'\r\n\r\n', 1)
    return int(head.split()[1]), json.loads(body[:content_length(reply)])


def content_length(reply: bytes) -> int:
    match = re.search(rb'(?i)content-length: (\d+)', reply)
    return int(match.group(1)) if match else 1 << 30


def test_a_chunked_body_over_the_limit_is_413_without_a_content_length(served):
    from gpt2_tf.serve import MAX_BODY

    piece = b' ' * (64 << 10)
    chunks = [b'{"prompt": "'] + [piece] * (MAX_BODY // len(piece) + 1) + [False]  # past 1 MiB, never ended
    status, body = chunked_request(served.port, chunks)
    assert status == 413
    assert_openai_error(body, 'over 1,048,576 bytes')


def test_a_chunked_body_under_the_limit_is_served(served):
    status, body = chunked_request(served.port, [b'{"prompt": "Hi", ', b'"max_tokens": 2, "temperature": 0}', True])
    assert status == 200, body
    assert body['usage']['completion_tokens'] <= 2 and body['choices'][0]['finish_reason'] in ('length', 'stop')


# --- requests that can never be served, and the refusals that stay ------------------------------------

def test_a_request_with_more_rows_than_the_queue_ever_holds_is_400_not_503(served):
    status, body = post(served.port, json.dumps({'prompt': ['a'] * 1000, 'max_tokens': 2}).encode())
    assert status == 400
    assert_openai_error(body, f'asks for 1000 rows .* queues at most {QUEUE}')
    status, body = post(served.port, json.dumps({'prompt': ['a', 'b'], 'n': 13, 'max_tokens': 2}).encode())
    assert status == 400  # 2 prompts x 13 = 26 rows > 24
    assert_openai_error(body, f'asks for 26 rows .* queues at most {QUEUE}')


def test_choices_without_rows_count_against_the_queue_too(served):
    # max_tokens 0 queues no row, but every choice is still built and answered: 13 prompts x 2 = 26 > 24
    status, body = post(served.port, json.dumps({'prompt': [[1]] * 13, 'n': 2, 'max_tokens': 0}).encode())
    assert status == 400
    assert_openai_error(body, f'asks for 26 rows .* queues at most {QUEUE}')
    status, body = post(served.port, json.dumps({'prompt': [[1]] * 12, 'n': 2, 'max_tokens': 0}).encode())
    assert status == 200 and len(body['choices']) == 24


def test_a_json_body_without_a_content_type_is_told_to_send_the_header(served):
    connection = http.client.HTTPConnection('127.0.0.1', served.port, timeout=60)
    connection.putrequest('POST', '/v1/completions', skip_accept_encoding=True)  # no Content-Type header at all
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    connection.putheader('Content-Length', str(len(body)))
    connection.endheaders(body)
    response = connection.getresponse()
    status, reply = response.status, json.loads(response.read())
    connection.close()
    assert status == 400
    assert_openai_error(reply, '^the body was sent without a Content-Type header: send JSON, with the header '
                               'Content-Type: application/json$')


def slow_scoring(monkeypatch, seconds: float) -> list:
    """Each group of an echo's scoring takes `seconds` longer; the list returned grows by one a group begun."""
    from gpt2_tf.serve import completion

    scored, score = [], completion.echo_entries

    def slowly(*args):
        scored.append(1)
        time.sleep(seconds)
        return score(*args)

    monkeypatch.setattr(completion, 'echo_entries', slowly)
    return scored


def test_a_client_that_leaves_during_an_echos_scoring_stops_it(model, monkeypatch):
    from gpt2_tf.serve import completion

    scored = slow_scoring(monkeypatch, 0.3)
    monkeypatch.setattr(completion, 'ECHO_TOKENS', 64)  # one prompt of 33..64 tokens a group: 20 groups
    with running(make_app(model)) as port:
        with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
            body = json.dumps({'prompt': [[7] * 40] * 20, 'max_tokens': 0, 'echo': True, 'logprobs': 2}).encode()
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
            settled(lambda: len(scored), lambda n: n >= 1)
        time.sleep(2)  # the server looks for a gone client every 0.25 s
        stopped = len(scored)
        time.sleep(1)
        assert len(scored) == stopped < 20, 'the scoring went on after its client left'


def test_an_echo_s_prompts_being_scored_count_against_the_queue_and_show_as_running(model, monkeypatch):
    scored = slow_scoring(monkeypatch, 0.5)
    echo = {'max_tokens': 0, 'echo': True, 'logprobs': 1}
    with running(make_app(model)) as port:
        first = threading.Thread(target=post, args=(port, json.dumps({'prompt': [[7, 8]] * 20, **echo}).encode()))
        first.start()
        settled(lambda: len(scored), lambda n: n >= 1)
        gauge = ('gpt2_tf_num_requests_running', frozenset())
        assert samples(port)[gauge] == 20
        for body in ({'prompt': [[7, 8]] * 5, **echo}, {'prompt': 'Hi', 'n': 5, 'max_tokens': 2}):  # 25 > QUEUE
            status, reply = post(port, json.dumps(body).encode())
            assert status == 503 and reply['error']['code'] == 'overloaded', reply
            assert reply['error']['message'] == 'the server is busy (20 rows waiting or being scored); retry shortly'
        assert post(port, json.dumps({'prompt': 'Hi', 'n': 4, 'max_tokens': 2}).encode())[0] == 200  # 24 fit
        first.join(60)
        assert samples(port)[gauge] == 0
        assert post(port, json.dumps({'prompt': [[7, 8]] * 24, **echo}).encode())[0] == 200
        # 12 prompts x n=2 rows and their 12 echoes scored: 36 > 24, on an idle server too, so never a 503
        status, reply = post(port, json.dumps({'prompt': [[7, 8]] * 12, 'n': 2, 'max_tokens': 1, 'echo': True,
                                               'logprobs': 1}).encode())
        assert status == 400 and 'asks for 36 rows' in reply['error']['message'], reply


def test_a_client_that_leaves_during_an_echo_frees_its_rows_once_the_group_being_scored_ends(model, monkeypatch):
    scored = slow_scoring(monkeypatch, 2.0)  # the thread scoring a group runs on when its client has gone
    gauge = ('gpt2_tf_num_requests_running', frozenset())
    with running(make_app(model)) as port:
        with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
            body = json.dumps({'prompt': [[7, 8]] * 20, 'max_tokens': 0, 'echo': True, 'logprobs': 1}).encode()
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
            settled(lambda: len(scored), lambda n: n >= 1)
        time.sleep(0.75)  # the server looks for a gone client every 0.25 s; the group ends at 2 s
        assert samples(port)[gauge] == 20, 'the queue let go of prompts still being scored'
        assert settled(lambda: samples(port)[gauge], lambda n: n == 0) == 0 and len(scored) == 1


def test_a_token_the_vocabulary_cannot_write_fails_the_request_as_the_servers_fault(random_checkpoint):
    from gpt2_tf.encoder import encoder_for
    from gpt2_tf.serve import create_app

    padded = gpt2_tf.load_model(random_checkpoint(HParams(n_vocab=50304, n_ctx=16, n_embd=16, n_head=2, n_layer=1)))
    app = create_app(padded, encoder_for(bundled_checkpoint()), model_id='padded', mode='eager', capacity=2,
                     queue_size=4)
    request = {'prompt': 'Hi', 'max_tokens': 3, 'logit_bias': {'50300': 100}}  # id 50300 has no text
    with running(app) as port:
        status, body = post(port, json.dumps(request).encode())
        assert status == 500 and body['error']['type'] == 'server_error', body
        assert body['error']['message'].startswith('generation failed: token id 50300 is outside the vocabulary')
        connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
        connection.request('POST', '/v1/completions', body=json.dumps({**request, 'stream': True}),
                           headers={'Content-Type': 'application/json'})
        events = connection.getresponse().read().decode().split('\n\n')
        connection.close()
    assert events[-3:] == [events[-3], 'data: [DONE]', ''], events
    assert json.loads(events[-3].removeprefix('data: '))['error']['message'].startswith('generation failed: token id')


def test_a_stream_that_meets_a_bug_still_ends_with_an_error_event_and_done(model, monkeypatch):
    from gpt2_tf.serve.completion import Choice

    def broken(self, tokens, log_probs):
        raise KeyError('a bug')

    monkeypatch.setattr(Choice, 'add', broken)
    with running(make_app(model)) as port:
        connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
        body = json.dumps({'prompt': 'Hi', 'max_tokens': 3, 'stream': True})
        connection.request('POST', '/v1/completions', body=body, headers={'Content-Type': 'application/json'})
        events = connection.getresponse().read().decode().split('\n\n')
        connection.close()
    assert events[-2:] == ['data: [DONE]', ''], events
    assert json.loads(events[-3].removeprefix('data: '))['error'] == {
        'message': 'the server failed on this request (KeyError); its log has the details', 'type': 'server_error',
        'param': None, 'code': None}


def test_a_request_that_can_never_fit_the_window_is_400(served):
    status, body = post(served.port, json.dumps({'prompt': [1] * 100, 'max_tokens': 100}).encode())
    assert status == 400
    assert_openai_error(body, r'prompt 0: 100 tokens \+ max_tokens 100 exceeds the window')
    assert body['error']['param'] == 'max_tokens'


@pytest.mark.parametrize('fields, param, message', [
    ({'temperture': 0.5}, 'temperture', "unknown field 'temperture'"),
    ({'stop': ['a', 'b', 'c', 'd', 'e']}, 'stop', 'stop takes up to 4 non-empty strings'),
    ({'logprobs': 6}, 'logprobs', 'less than or equal to 5'),
    ({'seed': -2 ** 63 - 1}, 'seed', 'out of range'),
    ({'seed': 2 ** 63}, 'seed', 'out of range'),
    ({'prompt': [True, 5]}, 'prompt', 'must be a string, a list of strings, a list of token ids (integers)'),
    ({'prompt': [[1, 2.0]]}, 'prompt', 'a list of token ids (integers) or a list of such lists'),
    ({'stream_options': {'include_usage': True}}, 'stream_options', 'only allowed with stream=true'),
    ({'suffix': ''}, 'suffix', 'suffix: not supported by this server: leave it out'),
])
def test_refusals_that_stay_name_their_field(served, fields, param, message):
    status, body = post(served.port, json.dumps({'prompt': 'Hi', 'max_tokens': 2, **fields}).encode())
    assert status == 400
    assert_openai_error(body, re.escape(message))
    assert body['error']['param'] == param


def test_an_unknown_model_is_404_model_not_found(served):
    status, body = post(served.port, json.dumps({'model': 'gpt-4', 'prompt': 'Hi', 'max_tokens': 2}).encode())
    assert status == 404
    assert set(body['error']) == {'message', 'type', 'param', 'code'}
    assert body['error']['code'] == 'model_not_found' and body['error']['param'] == 'model'


# --- a client that goes away --------------------------------------------------------------------------

class Dripping:
    """Stands in for the Batcher's submit: records the rows and feeds each a token every 20 ms until it is done."""

    def __init__(self):
        self.rows, self.delivered = [], 0

    def __call__(self, rows, scored=0):
        self.rows.extend(rows)
        threading.Thread(target=self._drip, args=(rows,), daemon=True).start()

    def _drip(self, rows):
        for _ in range(3000):  # a minute at most
            if all(row.done for row in rows):
                return
            for row in rows:
                if not row.done:
                    row.deliver([11], None)
                    self.delivered += 1
            time.sleep(0.02)


def test_a_client_that_disconnects_mid_stream_frees_its_row(model, monkeypatch):
    app = make_app(model)
    drip = Dripping()
    monkeypatch.setattr(app.state.batcher, 'submit', drip)
    with running(app) as port:
        with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
            body = json.dumps({'prompt': 'Hi', 'max_tokens': 120, 'stream': True}).encode()
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
            reply = b''
            while b'data: ' not in reply:  # the stream has begun
                data = sock.recv(65536)
                assert data, reply
                reply += data
        deadline = time.monotonic() + 60
        while not all(row.done for row in drip.rows) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(drip.rows) == 1 and drip.rows[0].done, 'the row still runs after its client left'
        assert drip.delivered < 3000


def test_a_client_that_leaves_before_a_whole_response_frees_its_rows(model, monkeypatch):
    log = io.StringIO()
    app = make_app(model, access_log=log)
    drip = Dripping()
    monkeypatch.setattr(app.state.batcher, 'submit', drip)
    with running(app) as port:
        with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
            body = json.dumps({'prompt': 'Hi', 'max_tokens': 120, 'n': 3}).encode()  # not streamed; 'Hi': 1 token
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: %d\r\n\r\n%s' % (len(body), body))
            settled(lambda: drip.delivered, lambda delivered: delivered >= 3)  # decoding has begun
        done = settled(lambda: [row.done for row in drip.rows], lambda done: len(done) == 3 and all(done))
        assert done == [True] * 3, 'the rows still run after their client left'
        assert drip.delivered < 3 * 120
        got = settled(lambda: samples(port), lambda got: any(name == 'gpt2_tf_requests_total' for name, _ in got))
    assert got[('gpt2_tf_requests_total', frozenset({'code': '499', 'outcome': 'disconnected'}.items()))] == 1
    assert re.fullmatch(r'gpt2-tf: POST /v1/completions 499 prompt_tokens=1 completion_tokens=\d+ latency_ms=\d+',
                        log.getvalue().strip()), log.getvalue()


def test_a_client_that_leaves_before_its_body_ends_is_counted_as_gone_not_refused(model):
    log = io.StringIO()
    app = make_app(model, access_log=log)
    with running(app) as port:
        with socket.create_connection(('127.0.0.1', port), timeout=60) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                         b'Content-Length: 1000\r\n\r\n{"prompt": ')  # 11 of the 1000 bytes, then it leaves
        got = settled(lambda: samples(port), lambda got: any(name == 'gpt2_tf_requests_total' for name, _ in got))
    assert [(labels, value) for (name, labels), value in got.items() if name == 'gpt2_tf_requests_total'] == \
        [(frozenset({'code': '499', 'outcome': 'disconnected'}.items()), 1)]
    assert re.fullmatch(r'gpt2-tf: POST /v1/completions 499 latency_ms=\d+', log.getvalue().strip()), log.getvalue()


def test_a_stopping_server_gives_its_requests_the_drain_then_fails_them_in_openai_s_shape(model, monkeypatch):
    from gpt2_tf.serve import bind
    from gpt2_tf.serve.server import CLOSING, DRAIN, draining

    log = io.StringIO()
    app = make_app(model, access_log=log)
    step = app.state.batcher.slots.step
    monkeypatch.setattr(app.state.batcher.slots, 'step', lambda *a, **k: (time.sleep(0.2), step(*a, **k))[1])
    scored = slow_scoring(monkeypatch, 4.0)  # the echo's one group: past the drain and the closing
    sock = bind('127.0.0.1', 0)
    port, server = sock.getsockname()[1], draining(app, 0.3)
    serving = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    serving.start()
    settled(lambda: server.started, bool)
    replies = {}
    bodies = {'decoding': {'prompt': 'Hi', 'max_tokens': 120},  # 15 chunks of 0.2 s at least: past the drain
              'scoring': {'prompt': [[7, 8]] * 20, 'max_tokens': 0, 'echo': True, 'logprobs': 1}}
    asking = [threading.Thread(target=lambda k=k: replies.update({k: post(port, json.dumps(bodies[k]).encode())}))
              for k in bodies]
    for thread in asking:
        thread.start()
    settled(lambda: app.state.batcher.chunks and scored, bool)
    with socket.create_connection(('127.0.0.1', port), timeout=60) as slow:  # a body that never ends
        slow.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                     b'Content-Length: 100\r\n\r\n{"prompt": ')
        server.handle_exit(signal.SIGTERM, None)  # as the signal would (uvicorn's handler)
        serving.join(0.3 + CLOSING + 10)
        assert not serving.is_alive(), 'the server did not stop after its drain'
        told = slow.recv(4096)
    assert told.startswith(b'HTTP/1.1 503') and b'the server is shutting down; retry on another' in told, told
    assert 'POST /v1/completions 503' in log.getvalue(), log.getvalue()
    for thread in asking:
        thread.join(30)
    assert set(replies) == set(bodies), replies  # each answered, none cut off
    for kind, (status, body) in replies.items():
        assert status == 500 and body['error']['message'] == 'generation failed: the server is shutting down', kind
    assert app.state.batcher.chunks < 15 and len(scored) == 1
    shown = subprocess.run([sys.executable, '-m', 'gpt2_tf.cli', 'serve', '--help'], capture_output=True, text=True)
    assert f'is shutting down (default: {DRAIN:g})' in ' '.join(shown.stdout.split())


def test_a_second_ctrl_c_fails_the_open_requests_in_openai_s_shape(model, monkeypatch):
    """uvicorn's forced exit cancels the requests: each still answered in OpenAI's shape, not with a text 500."""
    from gpt2_tf.serve import bind
    from gpt2_tf.serve.server import draining

    app = make_app(model)
    step = app.state.batcher.slots.step
    monkeypatch.setattr(app.state.batcher.slots, 'step', lambda *a, **k: (time.sleep(0.2), step(*a, **k))[1])
    sock = bind('127.0.0.1', 0)
    port, server = sock.getsockname()[1], draining(app, 60.0)
    serving = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    serving.start()
    settled(lambda: server.started, bool)
    replies = []
    asking = threading.Thread(target=lambda: replies.append(post(port, b'{"prompt": "Hi", "max_tokens": 120}')))
    asking.start()
    settled(lambda: app.state.batcher.chunks, bool)
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGINT, None)  # the second: at once
    serving.join(30)
    asking.join(30)
    assert not serving.is_alive() and replies, 'the server did not stop, or the request got no answer'
    status, body = replies[0]
    assert status == 500 and body == {'error': {'message': 'generation failed: the server is shutting down',
                                                'type': 'server_error', 'param': None, 'code': None}}, body


def test_time_per_output_token_is_per_decode_step():
    from gpt2_tf.serve.metrics import Metrics
    from gpt2_tf.serve.protocol import Usage

    metrics = Metrics(types.SimpleNamespace(running=0, waiting=0, scoring=0))
    four_choices = types.SimpleNamespace(  # 4 choices of 11 tokens each, side by side: 3 at 0.5 s, the last at 1.5
        complete=True, failed=False, started=0.0, first_token=0.5, first_count=3, last_token=1.5, longest=lambda: 11,
        usage=lambda: Usage(prompt_tokens=2, completion_tokens=44, total_tokens=46))
    metrics.record(200, four_choices)
    text = metrics.scrape().decode()
    assert 'gpt2_tf_time_per_output_token_seconds_sum 0.125' in text, text  # 1 s over the 8 after the first chunk
    one_chunk = types.SimpleNamespace(**{**vars(four_choices), 'first_count': 11, 'last_token': 0.5})
    metrics.record(200, one_chunk)  # every token arrived at once: no time per token to observe
    assert 'gpt2_tf_time_per_output_token_seconds_count 1.0' in metrics.scrape().decode()


# --- metrics --------------------------------------------------------------------------------------------

def samples(port) -> dict:
    """{(name, frozenset(labels)): value} of every sample /metrics shows."""
    from prometheus_client.parser import text_string_to_metric_families

    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    connection.request('GET', '/metrics')
    response = connection.getresponse()
    assert response.status == 200 and response.getheader('content-type').startswith('text/plain; version=0.0.4')
    text = response.read().decode()
    connection.close()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def settled(read, ready, seconds: float = 30):
    """read() once ready(read()) holds, or the last read after `seconds`: a request is counted and logged just
    after its response has gone, so its client may look before that."""
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if ready(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def greedy_tokens(model, prompt: str, length: int) -> int:
    """How many tokens the library's greedy draws before <|endoftext|>, at most length."""
    ids = gpt2_tf.encode(prompt)
    tokens = list(gpt2_tf.sample_sequence(model, length, context=ids, temperature=0, mode='eager')[0, len(ids):])
    return tokens.index(50256) if 50256 in tokens else length


def test_metrics_count_tokens_requests_and_latencies(model):
    app = make_app(model)
    with running(app) as port:
        client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=60)
        for prompt, length in (('Hello there', 6), ('One two three', 20)):  # one chunk of tokens, then three
            client.completions.create(model='test', prompt=prompt, max_tokens=length, temperature=0)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model='test', prompt='Hi', max_tokens=2, temperature=9)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model='gpt-4', prompt='Hi', max_tokens=2)
        post(port, b'{}', path='/v1/chat/completions')
        got = settled(lambda: samples(port), lambda got: sum(v for (name, _), v in got.items()
                                                             if name == 'gpt2_tf_requests_total') >= 5)
    prompt_tokens = len(gpt2_tf.encode('Hello there')) + len(gpt2_tf.encode('One two three'))
    completion_tokens = greedy_tokens(model, 'Hello there', 6) + greedy_tokens(model, 'One two three', 20)
    assert greedy_tokens(model, 'One two three', 20) > STREAM_CHUNK  # else nothing below has a second chunk
    assert got[('gpt2_tf_prompt_tokens_total', frozenset())] == prompt_tokens
    assert got[('gpt2_tf_generation_tokens_total', frozenset())] == completion_tokens

    def requests(code, outcome):
        return got.get(('gpt2_tf_requests_total', frozenset({'code': code, 'outcome': outcome}.items())), 0)

    assert requests('200', 'completed') == 2
    assert requests('400', 'refused') == 1 and requests('404', 'refused') == 2
    assert got[('gpt2_tf_time_to_first_token_seconds_count', frozenset())] == 2
    assert got[('gpt2_tf_time_per_output_token_seconds_count', frozenset())] == 1  # tokens after a first chunk
    assert got[('gpt2_tf_time_per_output_token_seconds_sum', frozenset())] > 0
    assert got[('gpt2_tf_time_to_first_token_seconds_sum', frozenset())] > 0
    assert got[('gpt2_tf_num_requests_running', frozenset())] == 0
    assert got[('gpt2_tf_num_requests_waiting', frozenset())] == 0


def test_a_stream_that_fails_after_its_first_chunk_ends_with_an_error_event_and_counts_as_failed(model, monkeypatch):
    from gpt2_tf.slots import Slots

    step, calls = Slots.step, []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError('the second chunk broke')
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Slots, 'step', second_fails)
    with running(make_app(model)) as port:
        client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=60)
        texts = []
        with pytest.raises(openai.APIError, match='generation failed: the second chunk broke'):
            for chunk in client.completions.create(model='test', prompt='Hi', max_tokens=3 * STREAM_CHUNK,
                                                   temperature=0, stream=True, extra_body={'top_k': 1}):
                texts.append(chunk.choices[0].text)
        assert texts  # the first chunk's text came before the error
        got = settled(lambda: samples(port), lambda got: sum(v for (name, _), v in got.items()
                                                             if name == 'gpt2_tf_requests_total') >= 1)
    assert got.get(('gpt2_tf_requests_total', frozenset({'code': '200', 'outcome': 'failed'}.items()))) == 1, got


def test_the_gauges_read_the_batcher_and_two_apps_keep_apart():
    from gpt2_tf.serve.metrics import Metrics

    first = Metrics(types.SimpleNamespace(running=3, waiting=5, scoring=2))  # rows running, and echoes scored
    second = Metrics(types.SimpleNamespace(running=1, waiting=0, scoring=0))  # a second registry: no duplicates
    first.generation_tokens.inc(7)
    text = first.scrape().decode()
    assert 'gpt2_tf_num_requests_running 5.0' in text and 'gpt2_tf_num_requests_waiting 5.0' in text
    assert 'gpt2_tf_generation_tokens_total 7.0' in text
    assert 'gpt2_tf_generation_tokens_total 0.0' in second.scrape().decode()


# --- the access log -----------------------------------------------------------------------------------

def test_each_request_writes_one_access_line(served, model):
    before = len(served.log.getvalue().splitlines())
    status, body = post(served.port, json.dumps({'prompt': 'Hello there', 'max_tokens': 4, 'temperature': 0}).encode())
    post(served.port, b'{}', path='/v1/chat/completions')
    lines = settled(lambda: served.log.getvalue().splitlines()[before:], lambda lines: len(lines) >= 2)
    prompt, completion = len(gpt2_tf.encode('Hello there')), greedy_tokens(model, 'Hello there', 4)
    assert len(lines) == 2, lines
    assert re.fullmatch(rf'gpt2-tf: POST /v1/completions 200 prompt_tokens={prompt} '
                        rf'completion_tokens={completion} latency_ms=\d+', lines[0]), lines[0]
    assert re.fullmatch(r'gpt2-tf: POST /v1/chat/completions 404 latency_ms=\d+', lines[1]), lines[1]


def test_serve_quiet_turns_the_access_log_off(monkeypatch):
    import gpt2_tf.serve
    from gpt2_tf.cli import main

    calls = []
    monkeypatch.setattr(gpt2_tf.serve, 'check_port', lambda host, port: None)
    monkeypatch.setattr(gpt2_tf.serve, 'serve', lambda *args, **kwargs: calls.append(kwargs['quiet']))
    for extra in ([], ['--quiet']):
        assert main(['serve', '--model_dir', bundled_checkpoint(), *extra]) in (0, None)
    assert calls == [False, True]


def test_a_row_whose_logits_are_nan_fails_its_request_in_one_line():
    import tensorflow as tf

    broken = gpt2_tf.load_model(bundled_checkpoint())
    gain = broken.ln_f.g
    gain.assign(tf.tensor_scatter_nd_update(gain, [[0]], [float('nan')]))
    with running(make_app(broken)) as port:
        status, body = post(port, json.dumps({'prompt': 'Hi', 'max_tokens': 3}).encode())
    assert status == 500 and body['error']['type'] == 'server_error', body
    assert body['error']['message'] == ("generation failed: the model's logits were not finite (NaN or +inf), so no "
                                        "token could be drawn: its weights hold NaN, or its activations overflowed "
                                        "its dtype (load it in float32)")


def test_a_full_queue_is_counted_as_refused_not_failed():
    from gpt2_tf.serve.metrics import outcome

    assert outcome(503) == 'refused'  # load shed on purpose: the client should retry, nothing broke
    assert outcome(500) == 'failed' and outcome(400) == 'refused' and outcome(499) == 'disconnected'
