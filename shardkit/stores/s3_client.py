"""The boto3 S3 client of one store: one client per store, its botocore session shared in the process.

Creating the first client of a botocore session loads the S3 service model and endpoint rules:
0.3–0.55 s on the 2-core machine of docs/s3.md. A further client of the same session costs about
0.04 s. So shardkit keeps one session of its own per AWS configuration (the ``AWS_*`` environment
variables and the ``~/.aws`` files' paths and modification times, hashed: no secret is held), at
most ``MAX_SESSIONS`` of them, and makes one client per store from it, closed with the store.
The second and later ``open_store`` of a process cost one cheap client; the first costs one
client instead of two (the endpoint is read from the configuration, not from a probe client).

boto3's default session (``boto3.DEFAULT_SESSION``, what ``boto3.client()`` uses) is never
touched: other libraries in the process see nothing of this. A botocore session is not
thread-safe, so clients are created under a lock; the clients themselves are.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict

from ..errors import InvalidInputError, StoreError
from .s3_errors import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, describe_client_error
from .s3_writer import S3Client

__all__ = ["AWS_HOST_SUFFIX", "MAX_SESSIONS", "make_client"]

AWS_HOST_SUFFIX = ".amazonaws.com"
MAX_SESSIONS = 4  # distinct AWS configurations kept; the least recently used is dropped

_lock = threading.Lock()
_sessions: OrderedDict[str, S3Client] = OrderedDict()  # configuration digest -> boto3 Session


def _configuration_digest() -> str:
    """A digest of what botocore's configuration chain reads: ``AWS_*`` variables and the ``~/.aws`` files."""
    digest = hashlib.sha256()
    for name in sorted(n for n in os.environ if n.startswith("AWS_")):
        digest.update(f"{name}\0{os.environ[name]}\0".encode(errors="surrogateescape"))
    for variable, default in (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE",
                                                                      "~/.aws/credentials")):
        path = os.path.expanduser(os.environ.get(variable, default))
        try:
            st = os.stat(path)
            stamp = f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}"
        except OSError:
            stamp = "-"
        digest.update(f"{path}\0{stamp}\0".encode(errors="surrogateescape"))
    return digest.hexdigest()


def _session() -> S3Client:
    """This process's boto3 session for the current AWS configuration (call with ``_lock`` held)."""
    import boto3
    import botocore.session

    key = _configuration_digest()
    session = _sessions.get(key)
    if session is None:
        session = boto3.session.Session(botocore_session=botocore.session.Session())
        _sessions[key] = session
        while len(_sessions) > MAX_SESSIONS:
            _sessions.popitem(last=False)
    _sessions.move_to_end(key)
    return session


def _configured_endpoint(session: S3Client) -> str | None:
    """The S3 endpoint the configuration names (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, a profile's
    ``endpoint_url``), or None for AWS's own: read the way botocore reads it when it makes a client."""
    from botocore.configprovider import ConfiguredEndpointProvider

    core = session._session  # noqa: SLF001 - the botocore session this module made and owns
    if core.get_config_variable("ignore_configured_endpoint_urls"):
        return None  # AWS_IGNORE_CONFIGURED_ENDPOINT_URLS: botocore uses AWS's endpoint
    found = ConfiguredEndpointProvider(full_config=core.full_config, scoped_config=core.get_scoped_config(),
                                       client_name="s3").provide()
    return str(found) if found else None


def make_client(connections: int) -> S3Client:
    """A new boto3 S3 client from the standard AWS configuration (path-style for a non-AWS endpoint); close it."""
    try:
        import boto3  # noqa: F401 - checked here, so a missing client is one line
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError as e:
        raise InvalidInputError("s3:// needs boto3: pip install 'shardkit[s3]'") from e
    config = Config(retries={"max_attempts": 1, "mode": "standard"}, max_pool_connections=connections,
                    connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    try:
        with _lock:
            session = _session()
            endpoint = _configured_endpoint(session)
            if endpoint is not None and AWS_HOST_SUFFIX not in endpoint:
                config = config.merge(Config(s3={"addressing_style": "path"}))
            return session.client("s3", config=config)
    except BotoCoreError as e:  # e.g. no region anywhere, a malformed endpoint or profile
        raise StoreError(f"s3://: the AWS configuration is not usable: {describe_client_error(e)}") from e
