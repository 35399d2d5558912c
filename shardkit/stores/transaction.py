"""Write a checkpoint into a store folder atomically, on a store without rename: publish last.

A reader of ``s3://BUCKET/PREFIX`` finds a checkpoint through its index. So the shards go first,
each by a streamed multipart upload; the manifest and configs (small ``.json`` objects) next; the
indexes last. Until the last ``put`` no index names a shard of this write, and the old index (if
any) still names intact old shards:

1. :class:`StoreTransaction` lists the prefix, reads its live indexes and refuses, before any byte
   is written, a shard name that is already an object there (an in-place reshard to the same
   names cannot be atomic without rename: write to a fresh prefix, or delete the old one first),
   and any object at all without ``overwrite=True``.
2. A small journal object (``.shardkit-write-TOKEN.json``) names the shards this write creates and
   the old shards it will delete, so ``recover`` can clean up after a SIGKILL.
3. On any failure or interrupt (``KeyboardInterrupt`` included) before the publish: the open upload
   is aborted and every object this write created is deleted; objects it did not create are never
   touched, the source least of all. One exception: a failure between the manifest's ``put`` and
   the index's deletes the new manifest even where it replaced the old one (the old checkpoint
   is left without a manifest rather than with a wrong one).
4. After the indexes are published: the old indexes no longer replaced, then the old shards no new
   index names, are deleted; then the journal.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType

from ..errors import InvalidInputError, Option, OutputExistsError, ShardkitError, StoreError, parts_of
from ..formats.links import loads_json
from ..formats.suffixes import MANIFEST_FILE
from .base import ObjectInfo, ObjectStore, ObjectWriter

__all__ = ["JOURNAL_PREFIX", "StoreTransaction", "index_names", "is_index", "recover_store"]

JOURNAL_PREFIX = ".shardkit-write-"
INDEX_SUFFIX = ".index.json"
MAX_INDEX_BYTES = 64 << 20  # an index past this is no index shardkit reads (a bound, not a guess)


def is_index(name: str) -> bool:
    return name.endswith(INDEX_SUFFIX)


def _publish_order(name: str) -> int:
    """0: data (streamed first), 1: manifest and configs, 2: indexes (last)."""
    return 2 if is_index(name) else 1 if name.endswith(".json") else 0


def index_names(store: ObjectStore, index: ObjectInfo) -> set[str]:
    """The objects an index in the store names (relative to the prefix), the index read with a bound."""
    where = store.url.child(index.name)
    weight_map = _read_json(store, index, what="an index", bad="not a readable index",
                            fix="delete or fix it first").get("weight_map", {})
    if not isinstance(weight_map, dict):
        raise InvalidInputError(f"{where}: its weight_map is not a mapping; delete or fix it first")
    folder = posixpath.dirname(index.name)
    names = {posixpath.join(folder, str(v)) for v in weight_map.values()}
    for name in names:
        store.url.key(name)  # a name from elsewhere never becomes a key outside the prefix
    return names


class StoreTransaction:
    """Create the objects ``names`` under the store's folder, publishing the indexes last.

    ``on_put(name)`` runs after each ``.json`` object is put at the publish (a caller's fault point).

    with StoreTransaction(store, names, overwrite=False) as tx:
        tx.stream("model-00001-of-00002.safetensors", chunks)  # ... every name, any order
        tx.commit()                                           # the .json objects, indexes last
    """

    def __init__(self, store: ObjectStore, names: Sequence[str], *, overwrite: bool = False,
                 on_put: Callable[[str], None] | None = None) -> None:
        self.store = store
        self.names = sorted(set(names), key=lambda n: (_publish_order(n), n))
        self._pending: dict[str, bytes] = {}
        self._streamed: set[str] = set()
        self._created: list[str] = []
        self._writer: ObjectWriter | None = None
        self._infos: dict[str, ObjectInfo] = {}
        self._published = False
        self._on_put = on_put or (lambda name: None)
        self.journal = f"{JOURNAL_PREFIX}{secrets.token_hex(8)}.json"
        existing = {o.name: o for o in store.list_objects()}
        if existing and not overwrite:
            raise OutputExistsError(f"{store.url}: the prefix already holds {len(existing)} object(s); "
                                    "pass ", Option("overwrite", True), " to replace the checkpoint there")
        self._existing = set(existing)
        live_indexes = [o for n, o in existing.items() if is_index(n)]
        live = {n for o in live_indexes for n in index_names(store, o)}
        clash = [n for n in self.names if _publish_order(n) == 0 and n in existing]
        if clash:
            what = "the live index names it" if clash[0] in live else "an object of that name exists"
            raise InvalidInputError(
                f"{store.url.child(clash[0])}: {what}; a store without rename cannot replace it atomically: "
                "write to a new prefix (or one with another shard count), or delete the old checkpoint first")
        keep = set(self.names)
        self.stale_indexes = sorted(o.name for o in live_indexes if o.name not in keep)
        # the one-file checkpoint an index replaces (model.safetensors beside model.safetensors.index.json)
        single = {n.removesuffix(".index.json") for n in self.names if is_index(n)} & set(existing)
        self.stale = sorted((live | single | ({MANIFEST_FILE} & set(existing))) - keep - set(self.stale_indexes))
        created = [n for n in self.names if _publish_order(n) == 0]
        # the .json objects put at the publish that a rollback deletes (new ones, and the manifest): a write killed
        # after their put but before the index's leaves them for recover, which deletes them if it never published
        held = [n for n in self.names if _publish_order(n) == 1 and _dropped_on_failure(n, self._existing)]
        store.put(self.journal, json.dumps({"created": created, "stale": self.stale, "held": held}).encode())

    # ------------------------------------------------------------------ writing

    def stream(self, name: str, chunks: Iterable[bytes | memoryview]) -> ObjectInfo:
        """Upload one object from ``chunks``: a data object by multipart now, a ``.json`` one held for commit."""
        if _publish_order(name) > 0:
            self._claim(name)
            data = b"".join(bytes(c) for c in chunks)
            self._pending[name] = data
            return ObjectInfo(name, len(data))
        with self.writer(name) as writer:
            for chunk in chunks:
                writer.write(chunk)
        return self._infos.pop(name)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[ObjectWriter]:
        """Write one data object by multipart upload, pushed in order (``writer.write(...)``).

        Committed when the block ends without an error; on an error its upload is aborted and the
        transaction rolls back. One object at a time: a store writes the shards one after another.

        with tx.writer("model-00001-of-00002.safetensors") as w:
            stream_safetensors(w, w.name, writes, source)
        """
        if _publish_order(name) > 0:
            raise StoreError(f"{self.store.url.child(name)}: a .json object is written with stream(), held for commit")
        if self._writer is not None:
            raise StoreError(f"{self.store.url.child(name)}: another object of this write is still open")
        self._claim(name)
        self._created.append(name)  # from here on ours to delete on failure (it did not exist before)
        self._writer = self.store.writer(name)
        with self._writer as writer:
            yield writer
            self._infos[name] = writer.commit()
        self._writer = None
        self._streamed.add(name)

    def _claim(self, name: str) -> None:
        if name not in self.names or name in self._streamed or name in self._pending or name in self._created:
            raise StoreError(f"{self.store.url.child(name)}: not an object of this write, or written twice")

    def compose(self, name: str, fill: Callable[[ObjectWriter], None]) -> ObjectInfo:
        """Upload one data object by ``fill(writer)`` (writes, or a store's own copy parts), then commit it."""
        with self.writer(name) as writer:
            fill(writer)
        return self._infos.pop(name)

    def adopt(self, names: Iterable[str]) -> None:
        """Take data objects that other processes of this write upload (the ranks of a collective write).

        Call it right after the journal is written, before any of them starts: from then on a
        rollback deletes them (none existed before: the constructor refused a clash), and
        :meth:`commit` counts them as written. The caller commits only once every process has
        reported its uploads complete.
        """
        for name in names:
            if _publish_order(name) > 0:
                raise StoreError(f"{self.store.url.child(name)}: not a data object of this write")
            self._claim(name)
            self._created.append(name)
            self._streamed.add(name)

    def commit(self) -> None:
        """Publish: every data object must be written; then the ``.json`` objects, indexes last; then clean up."""
        missing = [n for n in self.names if n not in self._streamed and n not in self._pending]
        if missing:
            raise StoreError(f"{self.store.url.child(missing[0])}: never written; nothing was published")
        for name in self.names:
            if name in self._pending:
                if _dropped_on_failure(name, self._existing):
                    self._created.append(name)  # a replaced manifest goes too: none beats a wrong one
                self.store.put(name, self._pending.pop(name))
                self._on_put(name)
        self._published = True
        self.store.delete(self.stale_indexes)  # no index names the old shards any more...
        self.store.delete(self.stale)          # ...so they can go
        self.store.delete([self.journal])

    # ------------------------------------------------------------------ failing

    def rollback(self) -> None:
        """Abort the open upload and delete what this write created (never anything else)."""
        if self._writer is not None:
            with contextlib.suppress(ShardkitError):
                self._writer.abort()
            self._writer = None
        self.store.delete(self._created)
        self._created = []
        self.store.delete([self.journal])

    def __enter__(self) -> StoreTransaction:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._published:
            return
        if kind is None:  # left without commit(): nothing is published, nothing stays
            self.rollback()
            return
        with contextlib.suppress(ShardkitError):  # the first failure is the one to report
            self.rollback()


def _dropped_on_failure(name: str, existing: set[str]) -> bool:
    """A ``.json`` object a failed write deletes: one it created, or the manifest (none beats a wrong one)."""
    return name not in existing or posixpath.basename(name) == MANIFEST_FILE


def recover_store(store: ObjectStore) -> list[str]:
    """Clean up after writes killed mid-way (SIGKILL, power loss): what was aborted or deleted, as URLs.

    Only shardkit's own leftovers: each write journal under the prefix, at any depth, names the
    objects its write created and the old ones it was to delete, relative to the journal's own
    folder (where that write's prefix was). Their multipart uploads are aborted, and those of
    them no live index names are deleted (a write killed before its publish leaves the old
    checkpoint whole; one killed after it, its new one). Uploads of other names are left alone.
    """
    journals = [o for o in store.list_objects() if posixpath.basename(o.name).startswith(JOURNAL_PREFIX)]
    records = [_journal_record(store, journal) for journal in journals]
    ours = {n for record in records for key in ("created", "stale") for n in record[key]}
    done: list[str] = []
    for upload in store.pending_uploads():
        if upload.name in ours:
            store.abort(upload)
            done.append(f"{store.url.child(upload.name)} (multipart upload aborted)")
    existing = {o.name: o for o in store.list_objects()}
    live = {n for name, o in existing.items() if is_index(name) for n in index_names(store, o)}
    orphans = sorted(n for n in ours if n in existing and n not in live)
    for record in records:  # a write killed between its manifest's put and its index's: that manifest is wrong
        if not live & record["created"]:
            orphans += sorted(n for n in record["held"] if n in existing and n not in orphans
                              and _put_by(store, existing[n], record["created"]))
    store.delete(orphans)
    store.delete([j.name for j in journals])
    done += [str(store.url.child(n)) for n in orphans] + [str(store.url.child(j.name)) for j in journals]
    return done


def _put_by(store: ObjectStore, held: ObjectInfo, created: set[str]) -> bool:
    """Whether the held ``.json`` object is the killed write's own: a new object is; a manifest only if it
    lists a shard that write created (else it is the old checkpoint's, left as it was)."""
    if posixpath.basename(held.name) != MANIFEST_FILE:
        return True
    files = _read_json(store, held, what="a manifest", bad="not a readable manifest",
                       fix="delete or fix it first").get("files", {})
    folder = posixpath.dirname(held.name)
    return isinstance(files, dict) and any(posixpath.join(folder, str(n)) in created for n in files)


def _read_json(store: ObjectStore, info: ObjectInfo, *, what: str, bad: str, fix: str) -> dict[str, object]:
    """The small JSON object ``info``, read with a bound; one line naming it if it is not a JSON object."""
    where = store.url.child(info.name)
    if info.size_bytes > MAX_INDEX_BYTES:
        raise StoreError(f"{where}: {info.size_bytes} bytes is too large for {what}")
    raw = bytearray(info.size_bytes)
    store.read_into(info.name, 0, memoryview(raw))
    try:
        doc = loads_json(raw)
    except ValueError as e:
        raise InvalidInputError(f"{where}: {bad} (", *parts_of(e), f"); {fix}") from e
    if not isinstance(doc, dict):
        raise InvalidInputError(f"{where}: {bad} (not a JSON object); {fix}")
    return doc


def _names(value: object) -> set[str]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of names, found {type(value).__name__}")
    return {str(n) for n in value}


def _journal_record(store: ObjectStore, journal: ObjectInfo) -> dict[str, set[str]]:
    """A write journal's names: ``created``, ``stale`` and ``held`` (absent from older journals), each checked
    and resolved against the journal's own folder (a name never leaves that folder)."""
    where = store.url.child(journal.name)
    record = _read_json(store, journal, what="a shardkit write journal", bad="not a shardkit write journal",
                        fix="delete it by hand")
    try:
        names = {key: _names(record.get(key, [])) for key in ("created", "stale", "held")}
    except TypeError as e:
        raise InvalidInputError(f"{where}: not a shardkit write journal ({e}); delete it by hand") from e
    folder = posixpath.dirname(journal.name)
    inside = store.url.child(folder) if folder else store.url
    for name in set().union(*names.values()):
        inside.key(name)  # checked: no '..', no absolute path, no control characters; never outside the folder
    return {key: {posixpath.join(folder, n) for n in found} for key, found in names.items()}
