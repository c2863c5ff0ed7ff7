"""The downloader against a real HTTP server on 127.0.0.1 serving an original-format checkpoint."""

import errno
import gzip
import hashlib
import http.server
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

from gpt2_tf import download
from gpt2_tf.download import DownloadError, FILES, download_model
from gpt2_tf.assets import bundled_vocabulary as bundled_files

from conftest import FIXTURES

ROOT = pathlib.Path(__file__).parent.parent


def published_files() -> dict:
    """The seven files of a model folder: the tiny fixture checkpoint plus the real vocabulary."""
    files = {name: (FIXTURES / 'tf1-tiny' / name).read_bytes() for name in FILES if name not in download.KNOWN_SHA256}
    for path in bundled_files():
        files[os.path.basename(path)] = pathlib.Path(path).read_bytes()
    return files


class Server:
    """Serves /models/124M/<file>; behaviour per file set by the test. Records (method, file, Range) per request."""

    def __init__(self):
        self.files = published_files()
        self.requests = []
        self.ranges = True
        self.drop_after = {}  # file -> bytes to send before dropping the connection, once
        self.errors = {}  # file -> [status, ...] to answer before serving
        self.head_allowed = True  # False: HEAD gets 405, as some mirrors do
        self.offset_ignored = False  # True: a Range request gets 206 from byte 0
        self.gzip = False  # True: gzip the body for a client that accepts it, as nginx's gzip_types does
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.respond(head=True)

            def do_GET(self):
                self.respond(head=False)

            def respond(self, head):
                name = self.path.rsplit('/', 1)[-1]
                server.requests.append((self.command, name, self.headers.get('Range')))
                if not self.path.startswith('/models/124M/') or name not in server.files:
                    return self.plain(404)
                if server.errors.get(name):
                    return self.plain(server.errors[name].pop(0))
                if head and not server.head_allowed:
                    return self.plain(405)
                body = server.files[name]
                gzipped = server.gzip and 'gzip' in (self.headers.get('Accept-Encoding') or '')
                body = gzip.compress(body) if gzipped else body
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                start = 0
                match = re.match(r'bytes=(\d+)-', self.headers.get('Range') or '')
                if_range = self.headers.get('If-Range')
                if match and server.ranges and not head and if_range in (None, etag):
                    start = int(match.group(1))
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header('Content-Range', f'bytes */{len(body)}')
                        self.send_header('Content-Length', '0')
                        self.end_headers()
                        return
                    if server.offset_ignored:
                        start = 0
                    self.send_response(206)
                    self.send_header('Content-Range', f'bytes {start}-{len(body) - 1}/{len(body)}')
                else:
                    self.send_response(200)
                self.send_header('ETag', etag)
                if gzipped:
                    self.send_header('Content-Encoding', 'gzip')
                self.send_header('Content-Length', str(len(body) - start))
                self.end_headers()
                if head:
                    return
                payload = body[start:]
                if name in server.drop_after:
                    payload = payload[:server.drop_after.pop(name)]
                    self.wfile.write(payload)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(payload)

            def plain(self, status):
                self.send_response(status)
                self.send_header('Content-Length', '0')
                self.end_headers()

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # clients that hang up early are part of these tests

        self.httpd = Quiet(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self.httpd.server_address[1]}/'
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, name):
        return [r for r in self.requests if r[0] == 'GET' and r[1] == name]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def fetch(server, tmp_path, **kwargs):
    return download_model('124M', str(tmp_path), base_url=server.url, quiet=True, backoff=0.01, **kwargs)


def assert_complete(server, folder):
    for name, body in server.files.items():
        assert (pathlib.Path(folder) / name).read_bytes() == body, name
    assert not list(pathlib.Path(folder).glob('*.part'))


def test_full_download_verifies_the_checkpoint(server, tmp_path):
    folder = fetch(server, tmp_path)
    assert folder == str(tmp_path / '124M')
    assert_complete(server, folder)
    assert sorted(os.listdir(folder)) == sorted(FILES)


def test_a_second_download_into_the_same_folder_at_once_is_refused(server, tmp_path):
    import fcntl

    partial = tmp_path / '124M.partial'
    partial.mkdir()
    held = os.open(partial, os.O_RDONLY)  # as the first download holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(DownloadError, match=r'another download into .*124M.partial is under way: let it finish'):
            fetch(server, tmp_path)
    finally:
        os.close(held)
    assert os.listdir(partial) == [] and not server.requests  # refused before it wrote or asked for anything
    assert_complete(server, fetch(server, tmp_path))  # once it is free


def test_old_name_maps_to_new(server, tmp_path):
    assert download_model('117M', str(tmp_path), base_url=server.url, quiet=True).endswith('124M')


def test_dropped_connection_resumes_with_range(server, tmp_path):
    data = 'model.ckpt.data-00000-of-00001'
    server.drop_after[data] = 150_000
    fetch(server, tmp_path)
    ranges = [r[2] for r in server.gets(data)]
    assert ranges[0] is None and len(ranges) == 2
    resumed_at = int(re.match(r'bytes=(\d+)-$', ranges[1]).group(1))
    assert 0 < resumed_at <= 150_000  # whole chunks received before the drop are kept
    assert_complete(server, tmp_path / '124M')


def test_part_file_from_an_earlier_run_resumes(server, tmp_path):
    data = 'model.ckpt.data-00000-of-00001'
    server.drop_after[data] = 150_000  # the first run stops in the data file, with no retries left
    with pytest.raises(DownloadError):
        fetch(server, tmp_path, retries=0)
    server.requests.clear()
    fetch(server, tmp_path)
    assert [r[2] for r in server.gets(data)][0].startswith('bytes=')
    assert_complete(server, tmp_path / '124M')
    assert not (tmp_path / '124M.partial').exists()


def test_part_file_whose_version_is_unknown_starts_over(server, tmp_path):
    # A .part with nothing that says which version of the file it holds, and no known hash.
    data = 'model.ckpt.data-00000-of-00001'
    (tmp_path / '124M.partial').mkdir()
    (tmp_path / '124M.partial' / (data + '.part')).write_bytes(b'x' * 1234)
    fetch(server, tmp_path)
    assert [r[2] for r in server.gets(data)] == [None]
    assert_complete(server, tmp_path / '124M')


class ChangeAfterDrop(dict):
    """A drop_after that cuts `name` after 140,000 bytes once, then serves new_bytes under that name."""

    def __init__(self, server, name, new_bytes):
        super().__init__()
        self.server, self.name, self.new_bytes = server, name, new_bytes

    def pop(self, name, default=None):
        if name != self.name:
            return default
        self.server.drop_after = {}
        self.server.files[name] = self.new_bytes
        return 140_000

    def __contains__(self, name):
        return name == self.name


def test_a_file_changed_on_the_server_is_not_spliced(server, tmp_path):
    data = 'model.ckpt.data-00000-of-00001'
    server.drop_after = ChangeAfterDrop(server, data, bytes(reversed(server.files[data])))  # same size, other bytes
    fetch(server, tmp_path, verify=False)
    got = (tmp_path / '124M' / data).read_bytes()
    assert got == server.files[data]  # all from the new version, none spliced from the old
    assert server.gets(data)[1][2].startswith('bytes=')  # it asked to resume, with If-Range: got it all again


def test_a_resume_at_the_wrong_offset_starts_over(server, tmp_path):
    data = 'model.ckpt.data-00000-of-00001'
    server.drop_after[data] = 150_000
    server.offset_ignored = True
    fetch(server, tmp_path)
    assert len(server.gets(data)) >= 3  # dropped, resumed at the wrong byte and refused, then whole
    assert_complete(server, tmp_path / '124M')


def test_a_mirror_that_rejects_head_does_not_refetch_complete_files(server, tmp_path):
    fetch(server, tmp_path)
    server.head_allowed = False
    server.requests.clear()
    fetch(server, tmp_path)
    assert [r for r in server.requests if r[0] == 'GET'] == []


def test_server_without_range_restarts_the_file(server, tmp_path):
    data = 'model.ckpt.data-00000-of-00001'
    server.ranges = False
    server.drop_after[data] = 150_000
    fetch(server, tmp_path)
    ranges = [r[2] for r in server.gets(data)]
    assert ranges[0] is None and ranges[1].startswith('bytes=')  # asked to resume, got 200, rewrote
    assert_complete(server, tmp_path / '124M')


def test_a_mirror_that_gzips_what_it_can_serves_the_files_as_they_are(server, tmp_path):
    server.gzip = True
    assert_complete(server, fetch(server, tmp_path))


def test_a_base_url_that_is_not_a_url_fails_at_once(server, tmp_path):
    for bad in ('127.0.0.1:1/', 'ftp://host/', 'http://exa mple/'):
        with pytest.raises(DownloadError, match=r'not a valid http\(s\) URL.*check --base-url') as e:
            download_model('124M', str(tmp_path), base_url=bad, quiet=True, backoff=100)  # a retry would hang
        assert 'gave up' not in str(e.value)


def test_404_is_a_clear_error(server, tmp_path):
    del server.files['model.ckpt.index']
    with pytest.raises(DownloadError, match=r'models/124M/model.ckpt.index: 404 Not Found'):
        fetch(server, tmp_path)
    assert not (tmp_path / '124M').exists()  # only a complete, verified download gets the model's name
    assert (tmp_path / '124M.partial' / 'hparams.json').exists()  # what was fetched stays for the next run


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(DownloadError, match="unknown model '7B'; the published models are 124M, 355M, 774M, 1558M"):
        download_model('7B', str(tmp_path))


def test_500_then_success_retries(server, tmp_path):
    server.errors['hparams.json'] = [500, 503]
    fetch(server, tmp_path)
    assert len(server.gets('hparams.json')) == 3
    assert_complete(server, tmp_path / '124M')


def test_persistent_500_gives_up(server, tmp_path):
    server.errors['hparams.json'] = [500] * 10
    with pytest.raises(DownloadError, match=r'server error 500; gave up after 3 attempts'):
        fetch(server, tmp_path, retries=2)


def test_corrupt_encoder_json_is_rejected(server, tmp_path):
    server.files['encoder.json'] = server.files['encoder.json'].replace(b'"the"', b'"teh"')
    with pytest.raises(DownloadError, match='encoder.json: sha256 mismatch: expected 196139668be6'):
        fetch(server, tmp_path)
    folder = tmp_path / '124M.partial'
    assert not [p.name for p in folder.glob('encoder.json*')]  # nor its .part.validator


def test_complete_files_are_skipped(server, tmp_path):
    fetch(server, tmp_path)
    server.requests.clear()
    fetch(server, tmp_path)
    assert [r for r in server.requests if r[0] == 'GET'] == []


def test_a_file_under_a_final_name_that_differs_from_the_servers_is_named_and_kept(server, tmp_path):
    fetch(server, tmp_path)
    index = tmp_path / '124M' / 'model.ckpt.index'
    index.write_bytes(index.read_bytes()[:100])  # say, cut short by another tool
    server.requests.clear()
    with pytest.raises(DownloadError, match=r'model.ckpt.index differs from the server.s \(100 bytes here, [\d,]+ at '
                                            r'.*\); it is left as it is: check --base-url, or delete the file'):
        fetch(server, tmp_path)
    assert [r for r in server.requests if r[0] == 'GET'] == [] and index.stat().st_size == 100
    index.unlink()
    fetch(server, tmp_path)  # as the message says: fetched again
    assert [r[1] for r in server.requests if r[0] == 'GET'] == ['model.ckpt.index']
    assert_complete(server, tmp_path / '124M')


def test_a_wrong_mirror_cannot_overwrite_a_model_nor_add_to_it(server, tmp_path):
    fetch(server, tmp_path)
    (tmp_path / '124M' / 'checkpoint').unlink()  # one file lacking, to be fetched
    before = {f.name: f.read_bytes() for f in (tmp_path / '124M').iterdir()}
    for name in server.files:  # a mirror that answers every path with its login page
        server.files[name] = b'<html>login</html>'
    server.requests.clear()
    with pytest.raises(DownloadError, match='differs from the server'):
        fetch(server, tmp_path)
    assert {f.name: f.read_bytes() for f in (tmp_path / '124M').iterdir()} == before
    assert [r for r in server.requests if r[0] == 'GET'] == []  # named before anything was fetched


def test_an_empty_folder_linked_from_the_models_folder_is_filled_where_it_is(server, tmp_path):
    (tmp_path / 'elsewhere').mkdir()  # say, on a larger disk
    (tmp_path / 'models').mkdir()
    (tmp_path / 'models' / '124M').symlink_to(tmp_path / 'elsewhere')
    fetch(server, tmp_path / 'models')
    assert (tmp_path / 'models' / '124M').is_symlink()
    assert_complete(server, tmp_path / 'elsewhere')


def test_a_partial_folder_beside_a_complete_model_is_removed(server, tmp_path):
    fetch(server, tmp_path)
    (tmp_path / '124M.partial').mkdir()  # an earlier repair's, interrupted
    (tmp_path / '124M.partial' / 'model.ckpt.index.part').write_bytes(b'x' * 10)
    fetch(server, tmp_path)
    assert not (tmp_path / '124M.partial').exists()


def test_an_interrupted_download_in_the_model_folder_resumes_there(server, tmp_path):
    fetch(server, tmp_path)
    index = tmp_path / '124M' / 'model.ckpt.index'
    body = index.read_bytes()
    index.unlink()
    (tmp_path / '124M' / 'model.ckpt.index.part').write_bytes(body[:100])  # an earlier version's, in place
    (tmp_path / '124M' / 'model.ckpt.index.part.validator').write_text('')
    fetch(server, tmp_path)
    assert_complete(server, tmp_path / '124M') and not (tmp_path / '124M.partial').exists()


def test_an_empty_folder_there_gets_no_file_until_the_whole_set_is_complete(server, tmp_path):
    (tmp_path / '124M').mkdir()  # made by hand
    server.errors['vocab.bpe'] = [500]
    with pytest.raises(DownloadError, match='gave up after 1 attempt'):
        fetch(server, tmp_path, retries=0)
    assert list((tmp_path / '124M').iterdir()) == []  # not six files of seven, which would look like a model
    server.requests.clear()
    fetch(server, tmp_path)  # resumed: only the missing file is fetched
    assert [r[1] for r in server.requests if r[0] == 'GET'] == ['vocab.bpe']
    assert_complete(server, tmp_path / '124M') and not (tmp_path / '124M.partial').exists()


def test_a_file_where_the_folder_goes_is_refused_before_any_request(server, tmp_path):
    (tmp_path / '124M').write_text('junk')
    with pytest.raises(DownloadError, match=r'124M is a file, where the model folder goes: move it away'):
        fetch(server, tmp_path)
    assert server.requests == []


def test_short_reads_give_up_and_keep_the_part(server, tmp_path):
    # A server that announces more bytes than it ever sends.
    data = 'model.ckpt.data-00000-of-00001'

    class AlwaysShort(dict):
        def pop(self, name, default=None):
            return 70_000 if name == data else default

        def __contains__(self, name):
            return name == data

    server.drop_after = AlwaysShort()
    server.files[data] = server.files[data] * 2  # 343,040 bytes: more than three short reads bring
    with pytest.raises(DownloadError, match=r'IncompleteRead.*gave up after 3 attempts \(run again to resume from .*data-00000-of-00001.part\)'):
        fetch(server, tmp_path, retries=2)
    assert (tmp_path / '124M.partial' / (data + '.part')).stat().st_size == 196_608  # kept for the next run
    assert not (tmp_path / '124M').exists()


def test_size_mismatch_is_an_error(server, tmp_path):
    # The file changes size between an interrupted request and its resumption.
    data = 'model.ckpt.data-00000-of-00001'
    server.drop_after = ChangeAfterDrop(server, data, server.files[data] + b'\0' * 1000)
    with pytest.raises(DownloadError, match=r'size mismatch: the server announced 171,520 bytes, then 172,520'):
        fetch(server, tmp_path)
    assert not [p.name for p in (tmp_path / '124M.partial').glob(data + '*')]  # nor its .part.validator


def test_disk_full_is_a_clear_error(server, tmp_path, monkeypatch):
    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, chunk):
            raise OSError(errno.ENOSPC, 'No space left on device')

    def fake_open(path, mode='r', *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if str(path).endswith('.part') else f

    monkeypatch.setattr(download, 'open', fake_open, raising=False)
    with pytest.raises(DownloadError, match=r'disk full while writing .*checkpoint.part; free some space'):
        fetch(server, tmp_path)


def test_verification_catches_a_mismatched_checkpoint(server, tmp_path):
    server.files['hparams.json'] = b'{"n_vocab": 512, "n_ctx": 32, "n_embd": 64, "n_head": 4, "n_layer": 2}'
    with pytest.raises(DownloadError, match='does not load .*does not match the model') as error:
        fetch(server, tmp_path)
    assert '\n' not in str(error.value)  # one line
    assert not (tmp_path / '124M').exists()
    assert fetch(server, tmp_path / 'unverified', verify=False)


def test_command_line(server, tmp_path):
    env = dict(os.environ, GPT2_TF_BASE_URL=server.url, TF_CPP_MIN_LOG_LEVEL='2')
    done = subprocess.run([sys.executable, str(ROOT / 'download_model.py'), '124M', '--models-dir', str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert 'gpt2-tf generate' in done.stdout
    assert done.stderr == ''  # no progress bars when piped, and none of TensorFlow's start-up lines
    assert_complete(server, tmp_path / '124M')
    missing = subprocess.run([sys.executable, str(ROOT / 'download_model.py'), '355M', '--models-dir', str(tmp_path)],
                             capture_output=True, text=True, env=env, cwd=ROOT)
    assert missing.returncode == 1
    assert missing.stderr.startswith('download_model.py: error: ') and '404 Not Found' in missing.stderr
    assert len(missing.stderr.splitlines()) == 1
    module = subprocess.run([sys.executable, '-m', 'gpt2_tf.download', '124M', '--models-dir', 'elsewhere'],
                            capture_output=True, text=True, env=env, cwd=tmp_path)  # what gpt2-tf's messages name
    assert module.returncode == 0, module.stderr
    assert_complete(server, tmp_path / 'elsewhere' / '124M')


def test_command_line_failures_write_at_most_three_lines(server, tmp_path):
    server.errors['hparams.json'] = [500] * 10
    env = dict(os.environ, GPT2_TF_BASE_URL=server.url)
    done = subprocess.run([sys.executable, str(ROOT / 'download_model.py'), '124M', '--models-dir', str(tmp_path),
                           '--retries', '2'], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert 1 <= len(lines) <= 3, lines
    assert 'retrying up to 2 times' in lines[0] and 'gave up after 3 attempts' in lines[-1]
    server.errors.clear()
    server.files['hparams.json'] = b'{"n_vocab": 512, "n_ctx": 32, "n_embd": 64, "n_head": 4, "n_layer": 2}'
    done = subprocess.run([sys.executable, str(ROOT / 'download_model.py'), '124M', '--models-dir', str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert 'does not load' in done.stderr


def test_the_default_is_five_retries_waiting_1_2_4_8_16_seconds(server, tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(download.time, 'sleep', waits.append)
    server.errors['hparams.json'] = [500] * 10
    with pytest.raises(DownloadError, match='gave up after 6 attempts'):
        download_model('124M', str(tmp_path), base_url=server.url, quiet=True)
    assert waits == [1, 2, 4, 8, 16]


def test_a_retry_count_that_is_not_a_whole_number_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        download.main(['124M', '--retries', '-1'])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "download_model.py: error: argument --retries: '-1' is not a whole number of 0 or more")


def test_known_hashes_match_the_bundled_files():
    for path in bundled_files():
        with open(path, 'rb') as f:
            assert hashlib.sha256(f.read()).hexdigest() == download.KNOWN_SHA256[os.path.basename(path)]
