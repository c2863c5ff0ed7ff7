"""The README runs: every fenced bash and Python block, as written, on a checkout with nothing downloaded.

The blocks run in order in one temporary folder, as a reader following along
would (a later block may read a file an earlier one wrote), with `.venv` there
linked to this checkout's environment, so that `.venv/bin/gpt2-tf` is the real
entry point. That folder is the one substitution. Three kinds of line are
checked instead of run: a block whose first line is `# needs: ...` (a download,
Docker, several hosts: it says what it needs), the setup commands (`python3 -m
venv .venv`, `.venv/bin/pip install -e ...`, which need the network; .ci/run
runs them for real), and the test suite's own command. A `gpt2-tf serve` block
starts the server; the Python block after it is its client, and the server is
stopped once the client is done.
"""

from __future__ import annotations

import os
import pathlib
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / 'README.md'
SETUP = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install -e (\S+) && ")
PIP = re.compile(r"^\.venv/bin/pip install -e '\.\[(\w+)\]'(\s+#.*)?$")
SUITE = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -n 2 --dist loadfile"
SERVER_PORT = 8000  # the README's


def blocks() -> list:
    """(line number, language, text) for each fenced block of the README."""
    found, lines = [], README.read_text(encoding='utf-8').splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith('```'):
            start, language = i + 1, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith('```'):
                i += 1
            found.append((start, language, '\n'.join(lines[start:i])))
        i += 1
    return found


def runnable() -> list:
    return [b for b in blocks() if b[1] in ('bash', 'python') and not b[2].startswith('# needs:')
            and b[2] != SUITE]


def as_run(text: str) -> str:
    """A bash block without its setup commands (checked in test_setup_lines_name_real_extras)."""
    lines = []
    for line in text.splitlines():
        line = SETUP.sub('', line)
        lines.append(':' if PIP.match(line) else line)
    return '\n'.join(lines)


def environment() -> dict:
    env = dict(os.environ)
    env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # a user's shell sets nothing
    return env


# --- what the README promises about its blocks -----------------------------------------------------

def test_every_block_runs_or_says_what_it_needs():
    for line, language, text in blocks():
        # text: a listing, not commands; the others run below, unless their first line says what they need
        assert language in ('bash', 'python', 'text'), f'README line {line}: name the block\'s language'
        if text.startswith('# needs:'):
            assert len(text.splitlines()[0]) > len('# needs: x'), f'README line {line}: say what it needs'


def test_the_readme_starts_with_the_two_commands_of_a_fresh_clone():
    first, second = blocks()[:2]
    assert SETUP.match(first[2]) and 'gpt2-tf generate' in first[2] and '\n' not in first[2]
    assert second[2] == SUITE
    ci = (ROOT / '.ci' / 'run').read_text()
    assert 'README.md' in ci and 'fence == 3' in ci  # .ci/run runs the README's second block
    top = README.read_text(encoding='utf-8')[:2500]
    assert '--model_name test' in top and 'gpt2_tf/assets/test-checkpoint' in top
    assert "-m 'not slow'" in top and 'minutes' in top  # how long the suite takes, and its fast part


def test_setup_lines_name_real_extras():
    extras = set(re.findall(r'^(\w+) = \[', (ROOT / 'pyproject.toml').read_text(), re.M))
    for line, language, text in blocks():
        for command in text.splitlines():
            match = PIP.match(command)
            if match:
                assert match.group(1) in extras, f'README line {line}: no extra {match.group(1)!r}'
            elif 'pip install' in command and language == 'bash' and not text.startswith('# needs:'):
                assert SETUP.match(command), f'README line {line}: an unexpected install: {command}'


# --- running them -------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp('readme')
    (folder / '.venv').symlink_to(ROOT / '.venv')
    state = {'folder': folder, 'server': None}
    yield state
    if state['server'] is not None:
        stop(state['server'])


def stop(process) -> None:
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start_server(text: str, state: dict) -> None:
    with socket.socket() as probe:
        if probe.connect_ex(('127.0.0.1', SERVER_PORT)) == 0:
            pytest.skip(f'port {SERVER_PORT}, the README\'s, is taken on this machine')
    process = subprocess.Popen(['bash', '-e', '-c', as_run(text)], cwd=state['folder'], env=environment(),
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    state['server'] = process
    seen, deadline = '', time.monotonic() + 300
    while 'serving' not in seen and time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stderr], [], [], 1)[0]:
            seen += process.stderr.readline()
    assert 'serving test-checkpoint on http://127.0.0.1:8000/v1' in seen, seen


@pytest.mark.slow
@pytest.mark.parametrize('line, language, text', runnable(), ids=[f'line{b[0]}-{b[1]}' for b in runnable()])
def test_readme_block_runs(workdir, line, language, text):
    if language == 'bash' and 'gpt2-tf serve' in text:
        start_server(text, workdir)
        return
    client = language == 'python' and workdir['server'] is not None
    if client and workdir['server'].poll() is not None:
        pytest.skip('the server block did not start')
    command = [sys.executable, '-c', text] if language == 'python' else ['bash', '-e', '-c', as_run(text)]
    try:
        done = subprocess.run(command, cwd=workdir['folder'], env=environment(), capture_output=True, text=True,
                              timeout=600)
    finally:
        if client:
            stop(workdir['server'])
            workdir['server'] = None
    assert done.returncode == 0, f'README line {line}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}'
    if language == 'python':  # the library prints nothing it was not asked to
        assert done.stderr == '', f'README line {line} wrote to stderr:\n{done.stderr[-3000:]}'
    else:
        assert 'Traceback' not in done.stderr, f'README line {line}:\n{done.stderr[-3000:]}'
