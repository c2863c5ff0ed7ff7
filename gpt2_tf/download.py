"""Downloading the published models: resumable, verified, safe to interrupt.

Each file is written to <file>.part, resumed with an HTTP Range request after
an interruption, checked against its size (and sha256 where it is known), and
only then renamed to its final name. So a final name always holds a complete
file, and a complete file is never fetched twice.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import re
import shutil
import sys
import time
import urllib.parse
from typing import Optional

from .hparams import OLD_NAMES, PUBLISHED
from .validate import GPT2Error, first_line

BASE_URL = 'https://openaipublic.blob.core.windows.net/gpt-2/'  # the original script's location
BASE_URL_ENV = 'GPT2_TF_BASE_URL'  # a mirror, when set
FILES = ['checkpoint', 'encoder.json', 'hparams.json', 'model.ckpt.data-00000-of-00001',
         'model.ckpt.index', 'model.ckpt.meta', 'vocab.bpe']
KNOWN_SHA256 = {
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
}
CHUNK = 1 << 16  # a dropped connection loses at most the chunk being read
IDENTITY = {'Accept-Encoding': 'identity'}  # the bytes as stored: sizes, ranges and hashes are of those


class DownloadError(GPT2Error):
    """A download that cannot complete; the message says why."""


class _Retry(Exception):
    """A failure worth another attempt (network error, 5xx, a short read)."""


def model_name(name: str) -> str:
    """The published name for a model, accepting the old names 117M and 345M."""
    name = OLD_NAMES.get(name, name)
    if name not in PUBLISHED:
        raise DownloadError(f'unknown model {name!r}; the published models are {", ".join(PUBLISHED)}')
    return name


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(CHUNK), b''):
            digest.update(block)
    return digest.hexdigest()


def _total_size(response) -> Optional[int]:
    if response.status_code == 206:
        match = re.match(r'bytes \d+-\d+/(\d+)', response.headers.get('Content-Range', ''))
        return int(match.group(1)) if match else None
    length = response.headers.get('Content-Length')
    return int(length) if length is not None else None


def _range_start(response) -> Optional[int]:
    match = re.match(r'bytes (\d+)-', response.headers.get('Content-Range', ''))
    return int(match.group(1)) if match else None


def _validator(response) -> Optional[str]:
    """What identifies this version of the file: a strong ETag, else Last-Modified (for If-Range)."""
    etag = response.headers.get('ETag')
    if etag and not etag.startswith('W/'):
        return etag
    return response.headers.get('Last-Modified')


def _discard(part: str) -> None:
    """Removes a partial file and what identified its version."""
    for path in (part, part + '.validator'):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _read_validator(part: str) -> Optional[str]:
    try:
        with open(part + '.validator', encoding='utf-8') as f:
            return f.read().strip() or None
    except OSError:
        return None


def _check_status(response, url: str) -> None:
    if response.status_code == 404:
        raise DownloadError(f'{url}: 404 Not Found (is the model name right, and the base URL?)')
    if response.status_code >= 500:
        raise _Retry(f'{url}: server error {response.status_code}')
    if response.status_code >= 400 and response.status_code != 416:
        raise DownloadError(f'{url}: HTTP {response.status_code} {response.reason}')


def _differs(session, url: str, path: str, sha256: Optional[str], timeout: float) -> Optional[str]:
    """How a file under its final name differs from the server's (its known hash, or its size), or None.

    A final name is only ever given to a verified file, so when the server cannot
    say (offline, or a mirror that rejects HEAD) the file counts as the server's.
    """
    import requests  # here, not at the top: finding a model folder imports this module too

    if sha256 is not None:
        return None if _sha256(path) == sha256 else f'its sha256 is not the published {sha256[:12]}...'
    try:
        response = session.head(url, headers=IDENTITY, timeout=timeout, allow_redirects=True)
    except requests.RequestException:
        return None
    size = response.headers.get('Content-Length')
    if response.status_code != 200 or size is None or int(size) == os.path.getsize(path):
        return None
    return f'{os.path.getsize(path):,} bytes here, {int(size):,} at {url}'


def _check_kept(session, url: str, path: str, sha256: Optional[str], timeout: float) -> None:
    """A file under its final name, complete once by the rule above: a difference now is the server's (a wrong
    mirror, a changed file) or damage, and the file is left as it is."""
    if (why := _differs(session, url, path, sha256, timeout)) is not None:
        raise DownloadError(f'{path} differs from the server\'s ({why}); it is left as it is: check --base-url, or '
                            f'delete the file to fetch it again')


def _attempt(session, url: str, part: str, *, timeout: float, progress, announced: dict) -> Optional[int]:
    """One request: appends to part from where it ends. Returns the total size, when the server says.

    announced['total'] keeps the size the first response gave; a later one that differs is an error.
    """
    import requests

    have = os.path.getsize(part) if os.path.exists(part) else 0
    seen = 'validator' in announced  # this process saw the file's first response
    validator = announced['validator'] if seen else _read_validator(part)
    if have and not (seen or validator or announced.get('sha256')):
        # Bytes from an earlier run that nothing identifies, and no hash to check them with:
        # resuming could splice two versions of the file, so start over.
        have = 0
    headers = dict(IDENTITY)
    if have:
        headers['Range'] = f'bytes={have}-'
        if validator:
            headers['If-Range'] = validator  # the server sends the whole file if it changed
    try:
        with session.get(url, headers=headers, stream=True, timeout=timeout) as response:
            _check_status(response, url)
            if response.status_code == 416:  # nothing left to send: part is whole, or wrong
                match = re.match(r'bytes \*/(\d+)', response.headers.get('Content-Range', ''))
                if match and int(match.group(1)) == have:
                    return have
                _discard(part)
                raise _Retry(f'{url}: the partial file does not fit the server\'s; starting over')
            total = _total_size(response)
            first = announced.setdefault('total', total)
            if None not in (first, total) and first != total:
                _discard(part)
                raise DownloadError(f'{url}: size mismatch: the server announced {first:,} bytes, '
                                    f'then {total:,} (the file changed?); run again to start over')
            if response.status_code == 206 and _range_start(response) != have:
                _discard(part)
                raise _Retry(f'{url}: the server resumed at byte {_range_start(response)}, not {have}; '
                             f'starting over')
            mode = 'ab' if response.status_code == 206 else 'wb'  # 200: Range ignored or file changed
            if mode == 'wb':
                have = 0
                announced['validator'] = _validator(response)
                with open(part + '.validator', 'w', encoding='utf-8') as f:
                    f.write(announced['validator'] or '')
            progress.reset(total=total)
            progress.update(have)
            with open(part, mode) as f:
                for chunk in response.iter_content(CHUNK):
                    f.write(chunk)
                    progress.update(len(chunk))
            size = os.path.getsize(part)
            if total is not None and size < total:  # the connection ended early without an error
                raise _Retry(f'{url}: got {size:,} of {total:,} bytes')
            return total
    except (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema):
        raise DownloadError(f'{url} is not a valid http(s) URL: check --base-url (or ${BASE_URL_ENV})') from None
    except requests.RequestException as e:
        raise _Retry(f'{url}: {type(e).__name__}: {e}') from None


def download_file(url: str, path: str, *, sha256: Optional[str] = None, retries: int = 5,
                  backoff: float = 1.0, timeout: float = 60.0, quiet: bool = False,
                  session: Optional[requests.Session] = None) -> bool:
    """Fetches url to path through path + '.part'. Returns False when path was already complete."""
    import requests
    from tqdm import tqdm

    session = session or requests.Session()
    if os.path.exists(path):
        _check_kept(session, url, path, sha256, timeout)
        return False
    part = path + '.part'
    name = os.path.basename(path)
    announced = {'sha256': sha256}
    with tqdm(desc=f'Fetching {name}', unit='B', unit_scale=True, unit_divisor=1024, file=sys.stderr,
              leave=True, disable=quiet or not sys.stderr.isatty()) as progress:
        for attempt in range(retries + 1):
            try:
                total = _attempt(session, url, part, timeout=timeout, progress=progress, announced=announced)
            except _Retry as e:
                if attempt == retries:
                    resume = f'run again to resume from {part}' if os.path.exists(part) else 'run again later'
                    attempts = f'{retries + 1} attempt{"s" if retries else ""}'
                    raise DownloadError(f'{e}; gave up after {attempts} ({resume})') from None
                if attempt == 0:  # one notice per file, however many retries follow
                    times = f'{retries} time{"s" if retries > 1 else ""}'
                    progress.write(f'download_model.py: {e}; retrying up to {times}', file=sys.stderr)
                time.sleep(backoff * 2 ** attempt)
                continue
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise DownloadError(f'disk full while writing {part}; free some space and run again '
                                        f'to resume') from None
                raise DownloadError(f'cannot write {part}: {e.strerror}') from None
            break
    size = os.path.getsize(part)
    if total is not None and size != total:
        _discard(part)
        raise DownloadError(f'{url}: size mismatch: got {size:,} bytes, the server announced {total:,}')
    if sha256 is not None:
        actual = _sha256(part)
        if actual != sha256:
            _discard(part)
            raise DownloadError(f'{name}: sha256 mismatch: expected {sha256}, got {actual} '
                                f'(a corrupt download or a wrong mirror)')
    os.replace(part, path)
    _discard(part)  # its validator
    return True


PARTIAL = '.partial'  # a model folder being downloaded: models_dir/<model>.partial


def partial_folder(folder: str) -> str:
    return folder.rstrip('/\\') + PARTIAL


@contextlib.contextmanager
def _alone(folder: str):
    """The download into folder, the only one: a second one at the same time is refused, since both would write
    the same .part files (a lock on the folder, released when its process ends however it ends)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unguarded
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DownloadError(f'another download into {folder} is under way: let it finish (or stop it), then '
                                f'run this one again') from None
        yield
    finally:
        os.close(fd)


def download_model(model: str, models_dir: str = 'checkpoints', *, base_url: Optional[str] = None,
                   verify: bool = True, quiet: bool = False, retries: int = 5, backoff: float = 1.0,
                   timeout: float = 60.0, verbose: bool = False) -> str:
    """Downloads a published model's seven files into models_dir/<model>; returns that folder.

    The files go to models_dir/<model>.partial (where interrupted downloads
    resume), which becomes models_dir/<model> only once every file is complete
    and verified, so a model folder is never half there (an empty folder there
    is filled the same way). A folder that an earlier run left is worked on in
    place: a file there under its final name that differs from the server's is
    named and left as it is. base_url defaults to
    $GPT2_TF_BASE_URL, then the original location. With verify, the checkpoint's
    names and shapes are checked against hparams.json.
    """
    model = model_name(model)
    base_url = base_url or os.environ.get(BASE_URL_ENV) or BASE_URL
    base_url = base_url if base_url.endswith('/') else base_url + '/'
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ('http', 'https') or not parts.netloc:
        raise DownloadError(f'{base_url} is not a valid http(s) URL: check --base-url (or ${BASE_URL_ENV})')
    final = os.path.join(models_dir, model)
    if os.path.exists(final) and not os.path.isdir(final):
        raise DownloadError(f'{final} is a file, where the model folder goes: move it away, or give another '
                            f'--models_dir')
    # A folder an earlier run left (complete, or interrupted) is worked on in place: its complete files are
    # checked, never replaced. Otherwise (none, or an empty one) the model is built in the .partial folder.
    folder = final if os.path.isdir(final) and (os.listdir(final) or os.path.islink(final)) else partial_folder(final)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise DownloadError(f'cannot create {folder}: {e.strerror}') from None
    with _alone(folder):
        import requests

        session = requests.Session()
        url = {filename: f'{base_url}models/{model}/{filename}' for filename in FILES}
        kept = [f for f in FILES if os.path.exists(os.path.join(folder, f))]
        for filename in kept:  # each checked before anything is fetched: a wrong mirror is named before it adds files
            _check_kept(session, url[filename], os.path.join(folder, filename), KNOWN_SHA256.get(filename), timeout)
        for filename in FILES:
            if filename not in kept:
                download_file(url[filename], os.path.join(folder, filename), sha256=KNOWN_SHA256.get(filename),
                              retries=retries, backoff=backoff, timeout=timeout, quiet=quiet, session=session)
            elif not quiet and sys.stderr.isatty():  # beside the progress bars, which need a terminal
                print(f'{filename}: already complete, skipped', file=sys.stderr)
        if verify:
            from . import quiet as tf_start

            tf_start.tensorflow(verbose=verbose)
            from .checkpoint import check_folder

            try:
                check_folder(folder)
            except (ValueError, FileNotFoundError) as e:
                raise DownloadError(f'the downloaded checkpoint does not load ({first_line(e)}); delete {folder} '
                                    f'and download again, or try another mirror') from None
        if folder != final:
            try:
                os.replace(folder, final)  # onto an empty folder too
            except OSError as e:
                raise DownloadError(f'cannot move {folder} to {final}: {e.strerror}') from None
        else:
            shutil.rmtree(partial_folder(final), ignore_errors=True)  # an earlier version's repair, of no use now
    return final


def _retries(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f'{text!r} is not a whole number of 0 or more')
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog='download_model.py', description='Download a published GPT-2 model, as the original script does.')
    parser.add_argument('model', help=f'one of {", ".join(PUBLISHED)} (117M and 345M are the old names), '
                                      f'or "list"')
    parser.add_argument('--models-dir', '--models_dir', default='checkpoints',
                        help='where model folders go (default: checkpoints)')
    parser.add_argument('--base-url', default=None,
                        help=f'a mirror to download from (default: ${BASE_URL_ENV}, else {BASE_URL})')
    parser.add_argument('--no-verify', action='store_true', help='skip the check that the checkpoint loads')
    parser.add_argument('--retries', type=_retries, default=5,
                        help='retries per file after a server error or a dropped connection, waiting 1, 2, 4, ... '
                             'seconds between them (default: 5)')
    parser.add_argument('--quiet', action='store_true', help='no progress bars')
    parser.add_argument('--verbose', action='store_true', help="show TensorFlow's start-up messages")
    args = parser.parse_args(argv)
    if args.model == 'list':
        print('\n'.join(PUBLISHED))
        return 0
    try:
        folder = download_model(args.model, args.models_dir, base_url=args.base_url, verify=not args.no_verify,
                                quiet=args.quiet, verbose=args.verbose, retries=args.retries)
    except DownloadError as e:
        print(f'download_model.py: error: {e}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('\ninterrupted; run the same command again to resume', file=sys.stderr)
        return 130
    name = os.path.basename(folder)
    where = '' if os.path.normpath(args.models_dir) == 'checkpoints' else f' --models_dir {args.models_dir}'
    print(f'{folder} is ready{"" if args.no_verify else " (checkpoint verified)"}. Sample from it with:\n'
          f'  gpt2-tf generate "Hello, I\'m a language model," --model_name {name}{where}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
