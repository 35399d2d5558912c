"""S3 listings with bounds: pages, entries and continuation tokens, each key and size checked.

A store that answers ``IsTruncated=true`` with a fresh continuation token forever, with pages
that are empty or hold only keys outside the prefix or ``folder/`` markers, would keep a plain
paginator running without end. :func:`bounded_pages` counts every page and every entry it
returns, kept or not, and stops in one line past :data:`MAX_LIST_PAGES` pages,
:data:`MAX_EMPTY_PAGES` truncated pages holding nothing, or ``max_entries`` entries; a token seen
before ends it too. :func:`listed_object` checks one listed key and size before it becomes an
:class:`~shardkit.stores.base.ObjectInfo`: no control characters in the name, a size S3 could hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from ..errors import StoreError
from .base import MAX_OBJECT_BYTES, ObjectInfo
from .urls import StoreUrl, has_control_characters

__all__ = ["MAX_EMPTY_PAGES", "MAX_LIST_PAGES", "bounded_pages", "listed_object"]

MAX_LIST_PAGES = 200  # S3 returns up to 1000 entries a page: 100,000 objects take 100 pages
MAX_EMPTY_PAGES = 20  # truncated pages with no entry at all: a store that says "more" and sends nothing
FIX = ("the endpoint does not answer like an S3 store (check AWS_ENDPOINT_URL), or the prefix holds more than one "
       "checkpoint: name a folder that holds one")

# A boto3 reply: a dict whose values are checked where read (boto3 ships no type information).
Reply = Mapping[str, object]
Fetch = Callable[[dict[str, str]], Reply]  # one page, given the cursor parameters of the request
Cursor = Callable[[Reply], dict[str, str]]  # the next page's cursor parameters, from a truncated reply


def bounded_pages(where: str, fetch: Fetch, cursor: Cursor, items: str, *, max_entries: int) -> Iterator[list[object]]:
    """The ``items`` of each page ``fetch`` returns, until one is not truncated; one line past a bound.

    ``fetch({})`` asks for the first page, ``fetch(cursor(reply))`` for the next. Every entry counts
    toward ``max_entries``, whether the caller keeps it or not.
    """
    entries = empty = 0
    seen: set[tuple[tuple[str, str], ...]] = set()
    params: dict[str, str] = {}
    for page in range(1, MAX_LIST_PAGES + 1):
        reply = fetch(params)
        found = reply.get(items) or []
        if not isinstance(found, list):
            raise StoreError(f"{where}: the store's listing page {page} holds no list of {items}; {FIX}")
        entries += len(found)
        if entries > max_entries:
            raise StoreError(f"{where}: the store listed more than {max_entries} entries (markers and keys outside "
                             f"the prefix included) in {page} pages; {FIX}")
        yield found
        if not reply.get("IsTruncated"):
            return
        empty += not found
        if empty > MAX_EMPTY_PAGES:
            raise StoreError(f"{where}: the store sent {empty} listing pages that hold nothing yet say more follow; "
                             f"{FIX}")
        params = cursor(reply)
        key = tuple(sorted(params.items()))
        if not any(params.values()) or key in seen:  # none, or one seen before: the listing would start over
            raise StoreError(f"{where}: the store's listing page {page} says more follow but gives no new "
                             f"continuation token; {FIX}")
        seen.add(key)
    raise StoreError(f"{where}: the store's listing did not end after {MAX_LIST_PAGES} pages ({entries} entries); "
                     f"{FIX}")


def listed_object(url: StoreUrl, prefix: str, entry: object) -> ObjectInfo | None:
    """One ``Contents`` entry as an object under ``prefix`` (its key and size checked), or None for a
    folder marker or a key outside the prefix (never ours to read)."""
    fields = entry if isinstance(entry, dict) else {}
    key, size = fields.get("Key"), fields.get("Size")
    if not isinstance(key, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise StoreError(f"{url}: the store listed an object without a valid key or size")
    if not key.startswith(prefix) or key.endswith("/"):
        return None
    if has_control_characters(key):
        raise StoreError(f"{url}: the listing holds the key {key!r}, whose name has control characters (a newline, "
                         "an escape sequence); refused: rename or delete that object")
    name = url.relative(key)
    if size > MAX_OBJECT_BYTES:
        raise StoreError(f"{url}/{name}: the listing gives it Size {size}, past S3's limit of {MAX_OBJECT_BYTES} "
                         f"bytes for one object; {FIX}")
    return ObjectInfo(name, size, str(fields.get("ETag", "")).strip('"'))
